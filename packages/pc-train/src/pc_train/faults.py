"""The hooks pc-train's fault and memory tests use: make a rank die or
stall, or run each rank under a memory cap.

:class:`FaultInjector` reads ``PC_TRAIN_FAULT=rank=1,step=3,phase=backward,action=kill``.
``action``: ``kill`` (SIGKILL itself), ``stall`` (sleep until killed),
``raise`` (raise :class:`InjectedFaultError`, an exception pc-train does
not expect), ``nan-grad`` (with ``phase=backward``: NaN gradients on this
rank while its loss stays finite), ``sigbus`` (SIGBUS itself, as a
write to a shared-memory page a full tmpfs cannot back does) or
``fill-disk`` (with ``path=FILE``: write ``FILE`` until its file system
has ``free=BYTES``, default 0, left: a disk that fills during the run);
``phase``: one of :data:`PHASES`. It exists for the fault tests
(integration_tests/fault/) and for trying the failure handling yourself;
it does nothing without the variable. What a surviving rank reports about
the others comes from pc-comm's health board (``pc_comm.health``).

:func:`join_memory_cgroup` reads ``PC_TRAIN_CGROUP=<name>``: each rank
joins the (cgroup v1) memory group ``<name>-rank<R>`` that the caller made
and capped, once its imports and process group are up, so only what it
allocates from then on counts against the cap; freed host memory is then
given back rather than kept (the kernel charges what the process keeps).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "ACTIONS",
    "PHASES",
    "FaultInjector",
    "InjectedFaultError",
    "fill_disk",
    "join_memory_cgroup",
    "nan_gradient",
]

PHASES = ("forward", "backward", "step", "save", "eval")
ACTIONS = ("kill", "stall", "raise", "nan-grad", "sigbus", "fill-disk")


class InjectedFaultError(RuntimeError):
    """The exception of ``action=raise``: a crash pc-train has no message for."""


class FaultInjector:
    """Kill, stall or crash this rank at one (step, phase), for fault tests."""

    def __init__(self, spec: str | None = None, rank: int | None = None) -> None:
        spec = os.environ.get("PC_TRAIN_FAULT", "") if spec is None else spec
        self.rank = dist.get_rank() if rank is None else rank
        self.target: tuple[int, int, str, str] | None = None
        self.fill: tuple[Path, int] | None = None  # fill-disk: the file to write, bytes left
        if not spec:
            return
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            target = (int(fields["rank"]), int(fields["step"]), fields["phase"], fields["action"])
            if target[3] == "fill-disk":
                self.fill = (Path(fields["path"]), int(fields.get("free", "0")))
        except (KeyError, ValueError):
            raise ValueError(
                f"PC_TRAIN_FAULT={spec!r}: expected rank=R,step=S,phase=P,action="
                f"{'|'.join(ACTIONS)} (fill-disk: and path=FILE, optionally free=BYTES)."
            ) from None
        if target[2] not in PHASES or target[3] not in ACTIONS:
            raise ValueError(
                f"PC_TRAIN_FAULT={spec!r}: phase must be one of {PHASES}, action one of {ACTIONS}."
            )
        self.target = target

    def at(self, phase: str, step: int) -> None:
        if self.target is None or self.target != (self.rank, step, phase, self.target[3]):
            return
        if self.target[3] == "nan-grad":
            return  # the loss carries it: see poison
        if self.fill is not None:
            fill_disk(*self.fill)
            return
        if self.target[3] in ("kill", "sigbus"):  # sigbus: as a page tmpfs cannot back
            os.kill(os.getpid(), signal.SIGKILL if self.target[3] == "kill" else signal.SIGBUS)
        if self.target[3] == "raise":
            raise InjectedFaultError(
                f"PC_TRAIN_FAULT: injected on rank {self.rank} in {phase} of step {step}"
            )
        while True:  # stall: a live rank that never arrives
            time.sleep(3600)

    def poison(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """``action=nan-grad`` at (this rank, ``step``, backward): ``loss``
        plus a term that is 0 forward and NaN backward (every gradient NaN,
        the loss finite); ``loss`` itself otherwise."""
        if self.target != (self.rank, step, "backward", "nan-grad"):
            return loss
        return nan_gradient(loss)


def fill_disk(path: Path, free: int = 0) -> None:
    """Append to ``path`` until its file system has at most ``free`` bytes
    free (or refuses more)."""
    with open(path, "ab", buffering=0) as file:  # unbuffered: nothing left to flush at close
        while (room := shutil.disk_usage(path.parent).free - free) > 0:
            try:
                file.write(b"\0" * min(room, 2**20))
            except OSError:
                return


def nan_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged forward; NaN as the gradient backward."""
    term: torch.Tensor = _NanGradient.apply(x)  # type: ignore[no-untyped-call]
    return x + term


class _NanGradient(torch.autograd.Function):
    """0 forward; NaN as the gradient of its input."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


def join_memory_cgroup(rank: int) -> bool:
    """Join ``PC_TRAIN_CGROUP``'s group for ``rank``; False without it."""
    name = os.environ.get("PC_TRAIN_CGROUP", "")
    if not name:
        return False
    from pathlib import Path

    from pc_comm import tune_host_allocator
    from pc_comm.host_allocator import RETURN_FREED

    group = Path("/sys/fs/cgroup/memory") / f"{name}-rank{rank}"
    if not (group / "cgroup.procs").exists():
        raise ValueError(
            f"PC_TRAIN_CGROUP={name!r}: {group} is not a memory cgroup; make it (and cap it) "
            "before starting pc-train."
        )
    tune_host_allocator(RETURN_FREED)  # what one phase frees, the next may need
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return True
