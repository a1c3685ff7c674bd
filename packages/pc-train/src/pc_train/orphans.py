"""A rank stops when its launcher dies (:func:`watch_launcher`), and no
process a rank forks holds the output directory's lock
(:func:`keep_lock_from_forks`).

[Note: orphaned ranks]
torchrun starts every worker in a Unix session of its own, so when
torchrun is killed (``kill -9`` of its process group, the OOM killer) its
ranks train on: they commit checkpoints and hold the run lock
([Note: the run lock] in :mod:`pc_train.lock`) until a write to a broken
pipe ends them. Under pc-train's own launcher torch sets SIGINT as the
ranks' parent-death signal, which made them save a checkpoint the run no
longer wanted, and only when their main thread ran Python.

A rank's launcher is its parent: torchrun's agent starts each worker with
``subprocess.Popen`` from its main thread; pc-train's launcher forks or
spawns them through ``torch.multiprocessing`` from its main thread (a
forkserver, where chosen, is a child of the launcher that exits with it).
When the parent dies the kernel reparents the rank, so ``os.getppid()``
no longer names the parent it started with. Two ways notice that:

- the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), set to
  a real-time signal this module handles: at once, while the main thread
  runs Python. It also fires when the *thread* that forked the rank exits
  in a living launcher, so the handler acts only when ``getppid()`` has
  changed;
- a daemon thread comparing ``getppid()`` with the parent every
  :data:`POLL_S` seconds: the bound while the main thread waits in C++ (a
  collective, a write), and the only way off Linux.

Either leaves one line on stderr naming the launcher and exits
:data:`pc_train.failures.EXIT_FAILURE` (1: rerun with ``--resume``) at
once, without saving: the job was killed, so the last committed
checkpoint stands, and a rank saving alone while the others are gone
would only wait for them. The kernel then releases the lock with the
rank's files. A rank whose work is over (it returned or failed, and
waits for a launcher to collect it) leaves silently with code 0.

The parent must be the one at start: the launcher may die before the
watch starts (while the rank imports torch or prepares), and the rank
would then watch whoever adopted it. This module records ``(pid, ppid)``
when it is imported: in a rank started by ``exec`` (torchrun, spawn) as
pc-train's command line starts, before it reads the model, the corpus or
a checkpoint; a rank forked after that import (pc-train's launcher) takes
its parent when the watch starts, microseconds after the fork. A launcher
that dies before the record (while the rank imports torch) takes the
job's store with it (torchrun's agent and pc-train's launcher serve it),
and the rank stops when it cannot join the store (within ``--timeout``).

Ranks started without a launcher (no ``TORCHELASTIC_RUN_ID``: a test
harness, a script, ``nohup``) have no launcher to outlive and are not
watched: a shell that exits does not end them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from pc_train.failures import EXIT_FAILURE

__all__ = ["POLL_S", "LauncherWatch", "keep_lock_from_forks", "parent_at_start", "watch_launcher"]

# Seconds between the watch thread's looks at getppid(): the bound on
# noticing a dead launcher while the main thread is inside C++.
POLL_S = 0.2

# PR_SET_PDEATHSIG from <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1

# A real-time signal nobody sends: torchrun forwards SIGUSR1/SIGUSR2 to its
# workers (--signals-to-handle, for Slurm), and SIGINT / SIGTERM mean "save
# and stop" to a rank.
_PARENT_DIED = signal.SIGRTMIN + 3 if sys.platform == "linux" else None

# (pid, parent pid) when this module was first imported [Note: orphaned ranks].
_STARTED = (os.getpid(), os.getppid())


def parent_at_start() -> int:
    """The pid of this process's launcher [Note: orphaned ranks]: its
    parent when pc-train first ran in it, or now for a process forked
    after that."""
    pid, parent = _STARTED
    return parent if pid == os.getpid() else os.getppid()


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel for ``signum`` when this process's parent dies (Linux);
    whether it took it. Replaces torch.multiprocessing's SIGINT."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class LauncherWatch:
    """Ends this rank when its launcher is gone [Note: orphaned ranks]."""

    def __init__(self, launcher: int, rank: str, checkpoint_dir: str) -> None:
        self.launcher = launcher  # the parent at start; a different getppid() means it died
        self.rank = rank  # for the line it leaves
        self.checkpoint_dir = checkpoint_dir  # where the user resumes from
        # What the rank is doing, for the line; the caller points it at its phases.
        self.where: Callable[[], str] = lambda: "start-up"
        self.done = False  # the rank's work is over: leave silently, code 0
        self._leaving = threading.Lock()  # the signal and the thread race to leave once
        self._thread = threading.Thread(target=self._poll, name="pc-train-launcher", daemon=True)

    def orphaned(self) -> bool:
        return os.getppid() != self.launcher

    def start(self) -> None:
        if _PARENT_DIED is not None and threading.current_thread() is threading.main_thread():
            signal.signal(_PARENT_DIED, self._on_signal)
            _set_parent_death_signal(_PARENT_DIED)
        if self.orphaned():  # it died before the kernel could be asked to tell
            self.leave()
        self._thread.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.orphaned():  # not the exit of the launcher thread that forked this rank
            self.leave()

    def _poll(self) -> None:
        while not self.orphaned():
            time.sleep(POLL_S)
        self.leave()

    def leave(self) -> None:
        """One line on stderr, then exit at once: no teardown, no save."""
        if not self._leaving.acquire(blocking=False):
            return  # the other path is leaving already
        if self.done:
            os._exit(0)
        try:
            where = self.where()
        except Exception:  # the line must not fail for want of a phase
            where = "an unknown phase"
        # stderr may have closed with the launcher, or be mid-write in this very thread.
        with contextlib.suppress(Exception):
            print(
                f"pc-train (rank {self.rank}): error: the launcher (pid {self.launcher}) is gone; "
                f"rank {self.rank} stops without saving (it was in {where}). Checkpoints saved so "
                f"far are in {self.checkpoint_dir}; continue with --resume.",
                file=sys.stderr,
                flush=True,
            )
        os._exit(EXIT_FAILURE)


def watch_launcher(rank: str, checkpoint_dir: str) -> LauncherWatch | None:
    """Start watching this rank's launcher, if a launcher started it; the
    watch, or None [Note: orphaned ranks]."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # started by hand: nothing to outlive
        return None
    watch = LauncherWatch(parent_at_start(), rank, checkpoint_dir)
    watch.start()
    return watch


def keep_lock_from_forks(lock: Path) -> None:
    """A process this one forks closes its copies of ``lock``'s descriptor
    (the run lock, [Note: the run lock]): the ``flock`` belongs to the open
    file, so a forked helper that outlived the rank would hold it. Closing a
    copy leaves this process's lock as it is; the descriptor is already
    closed on ``exec``."""
    try:
        held = os.stat(lock)
    except OSError:  # no lock file here: nothing to keep
        return
    key = (held.st_dev, held.st_ino)

    def close_lock_copies() -> None:
        try:
            descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
        except OSError:
            return
        for fd in descriptors:
            try:
                found = os.fstat(fd)
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if (found.st_dev, found.st_ino) == key:
                os.close(fd)

    os.register_at_fork(after_in_child=close_lock_copies)
