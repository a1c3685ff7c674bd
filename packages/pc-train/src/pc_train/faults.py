"""The hook pc-train's fault tests use to make a rank die or stall.

:class:`FaultInjector` reads ``PC_TRAIN_FAULT=rank=1,step=3,phase=backward,
action=kill`` (``action`` ``kill``: SIGKILL itself, ``stall``: sleep until
killed; ``phase`` one of :data:`PHASES`). It exists for the fault tests
(integration_tests/fault/) and for trying the failure handling yourself; it
does nothing without the variable. What a surviving rank reports about the
others comes from pc-comm's health board (``pc_comm.health``).
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

__all__ = ["PHASES", "FaultInjector"]

PHASES = ("forward", "backward", "step", "save", "eval")


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
