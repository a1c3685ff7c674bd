"""One run per ``--output-dir``: an advisory lock the run holds while it
trains (``<output-dir>/.pc-train.lock``, ``flock``).

[Note: the run lock]
Two runs writing one directory delete each other's ``step-N.partial`` and
prune each other's checkpoints. The launcher (or, under torchrun, rank 0)
takes an exclusive ``flock`` on the lock file before any rank trains and
writes who holds it (host, pid, start time); a second run is refused with
that holder named. The kernel releases a ``flock`` when its holder dies,
however it dies, so a lock is never stale in the kernel's sense; the file
may still name a holder that died without clearing it (SIGKILL), and the
next run takes it over saying so. ``flock`` is per host: on a network file
system shared by several hosts it may not exclude a run on another host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_NAME", "RunLockedError", "run_lock"]

LOCK_NAME = ".pc-train.lock"


class RunLockedError(ValueError):
    """Another run holds the output directory."""


def _describe(holder: dict[str, object]) -> str:
    started = holder.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
        if isinstance(started, int | float)
        else "unknown"
    )
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def _read(fd: int) -> dict[str, object]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


@contextmanager
def run_lock(output_dir: str | Path) -> Iterator[None]:
    """Hold ``output_dir``'s run lock while the block runs [Note: the run lock]."""
    path = Path(output_dir) / LOCK_NAME
    try:  # never through a link planted at the lock's name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise RunLockedError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where pc-train keeps its "
            "run lock: pc does not write through links. Remove the link."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(
                f"--output-dir {output_dir} is in use by another pc-train run "
                f"({_describe(_read(fd))}): two runs in one directory would delete each "
                "other's checkpoints. Wait for it to finish, or pass another --output-dir."
            ) from None
        previous = _read(fd)
        if previous:
            print(
                f"pc-train: taking over the lock of {output_dir} from a run that ended "
                f"without releasing it ({_describe(previous)}).",
                file=sys.stderr,
                flush=True,
            )
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(mine).encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: the next run takes it over silently
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
