"""What pc-train does when a rank dies or stalls, and the hook its fault
tests use to make one.

:class:`Phases` records, in the job's key-value store, what each rank is
doing ("backward of step 12", and since when). When a collective fails on a
rank (a peer's connection closed, or the ``--timeout`` passed), pc-train
reads the other ranks' entries and reports which rank is behind and where,
in the spirit of PyTorch's flight recorder, instead of a bare transport
error.

:class:`FaultInjector` reads ``PC_TRAIN_FAULT=rank=1,step=3,phase=backward,
action=kill`` (``action`` ``kill``: SIGKILL itself, ``stall``: sleep until
killed; ``phase`` one of :data:`PHASES`). It exists for the fault tests
(integration_tests/fault/) and for trying the failure handling yourself; it
does nothing without the variable.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["PHASES", "FaultInjector", "Phases", "RankFailureError"]

PHASES = ("forward", "backward", "step", "save", "eval")
_KEY = "pc-train/phase/{}"


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or stalled."""


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


class Phases:
    """This rank's current phase, published in the job's store."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.store = _store()
        self.current = "start"

    def enter(self, phase: str, step: int) -> None:
        current = f"{phase} of step {step}"
        if current == self.current:
            return  # accumulation re-enters backward: one store write per phase
        self.current = current
        if self.store is not None:
            value = f"{self.current}|{time.time():.3f}|{socket.gethostname()}|{os.getpid()}"
            self.store.set(_KEY.format(self.rank), value)

    def others(self) -> list[str]:
        """One line per other rank: where it is and for how long."""
        if self.store is None:
            return []
        lines, now = [], time.time()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                value = self.store.get(_KEY.format(rank)).decode()
            except Exception:  # the store's host may be gone too
                lines.append(f"rank {rank}: unknown (the store does not answer)")
                continue
            where, since, host, pid = value.rsplit("|", 3)
            if host == socket.gethostname() and not _alive(int(pid)):
                lines.append(f"rank {rank}: its process is gone (it was in {where})")
                continue
            lines.append(f"rank {rank}: in {where} for {now - float(since):.1f} s")
        return lines

    def failure(self, error: BaseException) -> RankFailureError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        others = self.others()
        behind = "; ".join(others) if others else "the other ranks' state is unknown"
        return RankFailureError(
            f"rank {self.rank} failed in {self.current}: a collective did not complete "
            f"({first[:200]}). Where the other ranks are: {behind}. The rank that has been in "
            "its phase longest, or that is gone, is the one to look at."
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child not yet reaped by its launcher is a zombie: gone too.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class FaultInjector:
    """Kill or stall this rank at one (step, phase), for fault tests."""

    def __init__(self, spec: str | None = None, rank: int | None = None) -> None:
        spec = os.environ.get("PC_TRAIN_FAULT", "") if spec is None else spec
        self.rank = dist.get_rank() if rank is None else rank
        self.target: tuple[int, int, str, str] | None = None
        if not spec:
            return
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            target = (int(fields["rank"]), int(fields["step"]), fields["phase"], fields["action"])
        except (KeyError, ValueError):
            raise ValueError(
                f"PC_TRAIN_FAULT={spec!r}: expected rank=R,step=S,phase=P,action=kill|stall."
            ) from None
        if target[2] not in PHASES or target[3] not in ("kill", "stall"):
            raise ValueError(
                f"PC_TRAIN_FAULT={spec!r}: phase must be one of {PHASES}, action kill or stall."
            )
        self.target = target

    def at(self, phase: str, step: int) -> None:
        if self.target is None or self.target != (self.rank, step, phase, self.target[3]):
            return
        if self.target[3] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # stall: a live rank that never arrives
            time.sleep(3600)


def comm_error(error: BaseException, names: Sequence[str] = ("Connection", "Timed out", "timeout",
               "closed", "Gloo", "NCCL", "DistBackendError", "recv", "send")) -> bool:  # fmt: skip
    """Whether ``error`` looks like a failed collective (a peer gone or late)."""
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, RuntimeError) and any(name in text for name in names)
