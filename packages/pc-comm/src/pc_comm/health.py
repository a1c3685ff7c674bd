"""Which rank failed, and where it was: a board of every rank's state in the
job's key-value store, read when an operation fails.

[Note: naming the failed rank]
A collective that fails because a peer died says only that a connection
closed (gloo) or that time ran out; it does not say which peer, or what that
peer was doing. So each rank keeps an entry in the store of the default
group: its host and pid, the phase the program last declared
(:func:`set_phase`, e.g. "backward of step 12") and the operation it last
started through a pc communicator ("all_reduce float32[4096] #57"). A daemon
thread republishes the entry every ``interval`` seconds, so a silent entry
means a dead process or host even across nodes; a phase change is published
at once, so the phase of a rank killed right after entering it is known.
Starting an operation only sets attributes: no store traffic on the hot path.

When an operation fails, :func:`diagnose` reads the peers' entries and
returns a :class:`PeerFailureError` naming, for each peer, whether its
process is gone (same host: its pid; any host: a silent entry), stopped or
frozen (same host: its state), or where it is and for how long, and how
many operations it has started against this rank's. The peer that is gone,
or furthest behind, is the one to look at.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "HealthBoard",
    "PeerFailureError",
    "RankState",
    "board",
    "diagnose",
    "gone_ranks",
    "group_timeout",
    "headline",
    "is_peer_failure",
    "op_name",
    "peers_report",
    "process_alive",
    "process_state",
    "set_group_timeout",
    "set_phase",
    "start_board",
    "started",
    "stop_board",
]

_KEY = "pc-comm/health/{}"


class PeerFailureError(RuntimeError):
    """An operation did not complete because another rank died or stalled.
    ``op``: the operation that waited; ``suspects``: the global ranks that
    are gone or furthest behind."""

    def __init__(self, message: str, op: str = "", suspects: list[int] | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.suspects = list(suspects or [])


@dataclass(frozen=True)
class RankState:
    """One rank's entry on the board."""

    rank: int
    host: str
    pid: int
    phase: str
    phase_since: float
    op: str
    ops: int  # operations started so far
    published: float  # time.time() of the entry

    def gone(self, now: float, interval: float) -> bool:
        """Its process is gone (on this host), or its entry has been silent
        too long (another host)."""
        if self.host == socket.gethostname():
            return not process_alive(self.pid)
        return now - self.published > 3 * interval + 2

    def describe(self, now: float, interval: float, mine: int) -> tuple[str, bool]:
        """A line about this rank, and whether it is a suspect."""
        where = f"it was in {self.phase}" if self.phase else "no phase declared"
        last = f"last operation {self.op} #{self.ops}" if self.ops else "no operation yet"
        here = self.host == socket.gethostname()
        if here and not process_alive(self.pid):
            return f"rank {self.rank}: its process is gone ({where}; {last})", True
        silent = now - self.published
        if silent > 3 * interval + 2:
            if not here:
                return (
                    f"rank {self.rank}: silent for {silent:.1f} s: its process or host is gone, "
                    f"or it is stopped ({where}; {last})",
                    True,
                )
            if process_state(self.pid) in ("T", "t"):  # [Note: stopped, frozen or gone]
                return (
                    f"rank {self.rank}: stopped, alive but not running (SIGSTOP, Ctrl-Z or a "
                    f"debugger holds pid {self.pid}; kill -CONT {self.pid} resumes it), silent "
                    f"for {silent:.1f} s ({where}; {last})",
                    True,
                )
            return (
                f"rank {self.rank}: frozen, its process (pid {self.pid}) is alive but has not "
                f"published for {silent:.1f} s: every thread blocked, swapping, or starved "
                f"of CPU ({where}; {last})",
                True,
            )
        behind = self.ops < mine
        lag = f", {mine - self.ops} operation(s) behind this rank" if behind else ""
        phase = f"in {self.phase} for {now - self.phase_since:.1f} s" if self.phase else "alive"
        return f"rank {self.rank}: {phase} ({last}{lag})", behind


class HealthBoard:
    """This rank's entry on the board, kept fresh by a daemon thread."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        group: Any = None,
        store_host: int | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval!r}.")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.host = socket.gethostname()
        self.phase = ""
        self.phase_since = time.time()
        # The last operation, formatted only when published or reported.
        self._last: tuple[str, torch.dtype | None, int] = ("", None, 0)
        self.ops = 0
        self.group = group  # the default group it was started for
        self._lock = threading.Lock()  # one store call at a time from this process
        # [Note: the store's host] The rank that serves the store (rank 0
        # without an agent's store), its last entry, and whether it is gone.
        self.store_host = store_host if store_host != rank else None
        self._host_entry: RankState | None = None
        self.store_gone = False
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._beat, name="pc-comm-health", daemon=True)
        self._thread.start()

    def started(self, op: str, tensor: torch.Tensor | None = None) -> None:
        """An operation starts (called by the communicators): two attribute
        writes, no formatting and no store traffic."""
        self._last = (op, None, 0) if tensor is None else (op, tensor.dtype, tensor.numel())
        self.ops += 1

    @property
    def op(self) -> str:
        """The last operation started ("all_reduce float32[4096]")."""
        return op_name(*self._last)

    def set_phase(self, phase: str) -> None:
        if phase == self.phase:
            return
        self.phase, self.phase_since = phase, time.time()
        self._publish()

    def _entry(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "pid": os.getpid(),
                "phase": self.phase,
                "phase_since": self.phase_since,
                "op": self.op,
                "ops": self.ops,
                "published": time.time(),
            }
        )

    def _store_up(self) -> bool:
        """False once the store's host is known gone: no more store calls,
        each of which would fail after torch printed a C++ stack."""
        if self.store_gone:
            return False
        entry = self._host_entry
        if entry is not None and entry.host == self.host and not process_alive(entry.pid):
            self.store_gone = True
        return not self.store_gone

    def _publish(self) -> None:
        # Never wait long for the lock: a heartbeat stuck on a store whose
        # host is gone must not stall the training loop in set_phase.
        if not self._lock.acquire(timeout=0.5):
            return
        try:
            if self._store_up():
                self.store.set(_KEY.format(self.rank), self._entry())
        except Exception:  # the store's host may be gone; the board is best effort
            pass
        finally:
            self._lock.release()

    def _beat(self) -> None:
        # The store's host's entry (its pid) as soon as it is published: a
        # job can lose it in its first second.
        deadline = time.monotonic() + 5.0
        while (
            self.store_host is not None
            and self._host_entry is None
            and time.monotonic() < deadline
            and not self._stop.wait(0.02)
        ):
            self._host_entry = self.read(self.store_host)
        while not self._stop.wait(self.interval):
            self._publish()
            if self.store_host is not None and not self.store_gone:
                entry = self.read(self.store_host)  # where it is, kept for when it dies
                self._host_entry = entry if entry is not None else self._host_entry

    def read(self, rank: int) -> RankState | None:
        """``rank``'s entry; None if it has none or the store does not
        answer. The store's host's last entry once it is gone."""
        if not self._store_up():  # no lock: the heartbeat may be stuck on that store
            return self._host_entry if rank == self.store_host else None
        # Bounded: a heartbeat stuck on a store whose host is gone holds the lock.
        if not self._lock.acquire(timeout=2 * self.interval + 1):
            return None
        try:
            # check() does not block on a missing key, unlike get().
            if not self.store.check([_KEY.format(rank)]):
                return None
            raw = json.loads(self.store.get(_KEY.format(rank)).decode())
            return RankState(rank=rank, **raw)
        except Exception:  # the store's host gone, or an entry of another version
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)


_board: HealthBoard | None = None


def board() -> HealthBoard | None:
    """This process's board, or None when none was started."""
    return _board


def op_name(op: str, dtype: torch.dtype | None = None, numel: int = 0) -> str:
    """``all_reduce float32[4096]``, or ``op`` alone without a tensor."""
    if dtype is None:
        return op
    return f"{op} {str(dtype).removeprefix('torch.')}[{numel}]"


def start_board(interval: float = 1.0) -> HealthBoard:
    """Start (or return) this rank's entry on the board of the default
    group. :func:`pc_comm.init_distributed` calls it."""
    global _board
    if not dist.is_initialized():
        raise RuntimeError("start_board needs an initialised default process group.")
    if _board is not None:
        if _board.group is dist.group.WORLD:
            return _board
        stop_board()  # a board of an earlier, destroyed group
    from torch.distributed.distributed_c10d import _get_default_store

    # Rank 0 serves the store, unless torchrun's agent does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    _board = HealthBoard(
        _get_default_store(),
        dist.get_rank(),
        dist.get_world_size(),
        interval=interval,
        group=dist.group.WORLD,
        store_host=None if agent_store else 0,
    )
    return _board


def stop_board() -> None:
    global _board
    if _board is not None:
        _board.close()
        _board = None


# [Note: the board at exit] The heartbeat thread is a daemon: left running,
# it can be inside a store call in C++ while the interpreter tears down, and
# the process then dies with "terminate called without an active exception"
# (5 of 39 runs of a 4-rank script, 0 of 20 without the board). Stopping it
# before teardown ends that; without a board this does nothing.
atexit.register(stop_board)


def set_phase(phase: str) -> None:
    """Declare what this rank is doing ("backward of step 12"); shown for
    this rank when another rank's operation fails. A no-op without a board."""
    if _board is not None:
        _board.set_phase(phase)


def started(op: str, tensor: torch.Tensor | None = None) -> None:
    """Note that ``op`` on ``tensor`` starts (the communicators call it)."""
    if _board is not None:
        _board.started(op, tensor)


_SYMPTOMS = ("connection", "timed out", "timeout", "closed", "reset by peer", "broken pipe")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` looks like an operation that failed because a peer
    went away or is late, rather than a mistake in the call."""
    if isinstance(error, PeerFailureError | dist.DistError):  # DistBackendError, DistNetworkError
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(name in text for name in _SYMPTOMS)


def diagnose(
    error: BaseException, op: str | None = None, ranks: list[int] | None = None
) -> PeerFailureError:
    """A :class:`PeerFailureError` for ``error``, raised by ``op`` (default:
    the last operation this rank started), with where each other rank of
    ``ranks`` (global ranks; default: all) is."""
    text = str(error).strip()
    cause = text.splitlines()[0][:200] if text else type(error).__name__
    if op:
        what, waited = op, op
    else:  # a torch.distributed call made directly: not on the board
        last = f"{_board.op} #{_board.ops}" if _board is not None and _board.op else ""
        what = ""
        waited = "an operation" + (f" (its last through pc-comm: {last})" if last else "")
    if any(symptom in text.lower() for symptom in _CONNECTION_LOST):
        _await_a_death(ranks)
    report, suspects = peers_report(ranks)
    return PeerFailureError(f"{headline(waited, cause)} {report}", what, suspects)


# [Note: sockets close before the process is gone]
# A killed rank's connections are closed while the kernel tears the process
# down, before /proc shows it dead (or a zombie): the peer's collective can
# fail with "reset by peer" a moment before the dead rank can be told from
# a live one. On a lost connection the report waits for that moment.
_CONNECTION_LOST = ("reset by peer", "closed", "broken pipe")
_DEATH_WAIT_S = 2.0


def _await_a_death(ranks: list[int] | None) -> None:
    """Wait (at most ``_DEATH_WAIT_S``) until a rank of ``ranks`` on this
    host shows as gone."""
    if _board is None:
        return
    board = _board
    every = [
        r for r in (ranks if ranks is not None else range(board.world_size)) if r != board.rank
    ]
    states = [board.read(rank) for rank in every]
    pids = [s.pid for s in states if s is not None and s.host == board.host]
    deadline = time.monotonic() + _DEATH_WAIT_S
    while pids and time.monotonic() < deadline:
        if any(not process_alive(pid) for pid in pids):
            return
        time.sleep(0.05)


def gone_ranks() -> list[int]:
    """The other ranks whose process is gone (see :meth:`RankState.gone`);
    empty without a board, or for ranks whose entry cannot be read."""
    if _board is None:
        return []
    board, now = _board, time.time()
    gone = []
    for rank in range(board.world_size):
        if rank == board.rank:
            continue
        state = board.read(rank)
        if state is not None and state.gone(now, board.interval):
            gone.append(rank)
    return gone


def headline(op: str, cause: str) -> str:
    """``rank R failed in <phase>: <op> did not complete (<cause>).``"""
    me = _board.rank if _board is not None else (dist.get_rank() if dist.is_initialized() else 0)
    where = f" in {_board.phase}" if _board is not None and _board.phase else ""
    return f"rank {me} failed{where}: {op} did not complete ({cause})."


def peers_report(ranks: list[int] | None = None) -> tuple[str, list[int]]:
    """Where the other ranks of ``ranks`` (global ranks; default: all) are,
    as a sentence, and the suspects among them: gone, silent, or behind
    this rank."""
    if _board is None:
        return (
            "Where the other ranks are is unknown: start the health board "
            "(pc_comm.init_distributed does) to learn it.",
            [],
        )
    now = time.time()
    every = ranks if ranks is not None else range(_board.world_size)
    lines, suspects = [], []
    for rank in (r for r in every if r != _board.rank):
        state = _board.read(rank)
        if state is None:
            why = (
                f"the job's store went down with rank {_board.store_host}"
                if _board.store_gone
                else "no entry, or the store does not answer"
            )
            lines.append(f"rank {rank}: unknown ({why})")
            continue
        line, suspect = state.describe(now, _board.interval, _board.ops)
        lines.append(line)
        if suspect:
            suspects.append(rank)
    behind = "; ".join(lines) if lines else "no other rank"
    blame = (
        f" Look at rank(s) {', '.join(map(str, suspects))}."
        if suspects
        else " The rank in its phase longest is the one to look at."
    )
    return f"Where the other ranks are: {behind}.{blame}", suspects


# [Note: stopped, frozen or gone]
# A peer whose entry is silent is gone, stopped or frozen. On this host
# the three are told apart: no process (or a zombie) is gone; a process in
# state T (SIGSTOP, SIGTSTP) or t (a tracer's stop) is stopped: alive, and
# resumed by SIGCONT; any other state is frozen (alive, publishing
# nothing: its heartbeat thread cannot run). On another host only the
# silence is known, and the line says all three.


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from ``/proc/<pid>/stat`` (``R``,
    ``S``, ``T``, ...); None where it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs. A process that has
    exited or was killed but that its parent has not reaped yet (a zombie,
    as under a launcher slow to wait for its children) is gone, though
    ``kill(pid, 0)`` still finds it: Linux's ``/proc/<pid>/stat`` state
    says so (``Z`` zombie, ``X`` dead). Elsewhere, ``kill(pid, 0)``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc here: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# [Note: one timeout for every path]
# The user gives one timeout (init_distributed's, pc-train's --timeout);
# pc-comm's own paths (shared-memory collectives and sends) wait that long
# too unless told otherwise, so a stalled peer surfaces within it on every
# path, not after each path's own default.
_group_timeout_s: float | None = None


def set_group_timeout(seconds: float) -> None:
    """Record the timeout the default process group was started with
    (:func:`pc_comm.init_distributed` does)."""
    global _group_timeout_s
    _group_timeout_s = float(seconds)


def group_timeout() -> float:
    """Seconds pc-comm's own waits last by default: the default process
    group's timeout as :func:`pc_comm.init_distributed` set it, else what
    the group reports, else 300."""
    if _group_timeout_s is not None:
        return _group_timeout_s
    if dist.is_initialized():
        try:  # a group started by torch directly: its backend knows
            world = dist.group.WORLD
            assert world is not None
            backend = world._get_backend(torch.device("cpu"))
            return float(backend.options._timeout.total_seconds())
        except Exception:  # private API; fall back below
            pass
    return 300.0
