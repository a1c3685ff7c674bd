"""Where a rank is and how it stops: :class:`Phases` declares what the rank
is doing on pc-comm's health board, for the failure reports of the other
ranks; :class:`Stop` turns SIGINT / SIGTERM into a stop the ranks agree on
at a step's end (and leaves at once when a peer is gone)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import health
from pc_train.failures import leave

__all__ = ["Phases", "Stop"]


class Phases:
    """What this rank is doing ("backward of step 12"), declared on pc-comm's
    health board, where the other ranks read it when an operation fails."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.current = "start-up"

    def enter(self, phase: str, step: int | None = None) -> None:
        """``phase`` of ``step``, or ``phase`` alone (start-up, the report)."""
        current = phase if step is None else f"{phase} of step {step}"
        if current != self.current:  # accumulation re-enters backward
            self.current = current
            health.set_phase(current)


# How long a rank stopped by the launcher after a peer died waits for its own
# error about that peer (shared memory notices in 50 ms, gloo at once).
_PEER_ERROR_S = 2.0


class Stop:
    """SIGINT / SIGTERM ask for a stop; the ranks agree on the step, save a
    checkpoint there and exit. The same tiny all-reduce, once per step
    before the optimizer steps, carries each rank's finite-loss check."""

    def __init__(self, phases: Phases, grace: float) -> None:
        self.asked = False
        self.phases = phases
        self.grace = grace  # after SIGTERM, seconds to reach the step's end and save
        self.timer: threading.Thread | None = None
        self.agreed = False  # every rank agreed to stop: they save together and exit
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = True
        if signum == signal.SIGTERM and self.timer is None:
            # A scheduler's preemption or the launcher stopping the job after
            # another rank failed. A rank blocked on a dead peer never reaches
            # the step's end: leave after the grace period, saying where it was.
            # When a peer is gone (the failure that made the launcher stop
            # the job) before the ranks agreed to stop, no step can finish:
            # leave at once.
            self.timer = threading.Thread(target=self._leave_when_stuck, daemon=True)
            self.timer.start()

    def _leave_when_stuck(self) -> None:
        deadline = time.monotonic() + self.grace
        gone: list[int] = []
        while time.monotonic() < deadline and (self.agreed or not gone):
            time.sleep(0.1)
            gone = [] if self.agreed else health.gone_ranks()
        if gone:
            # This rank's own error, waiting on the gone peer, names it and
            # where every rank was: give it a moment to come first.
            time.sleep(min(_PEER_ERROR_S, max(0.0, deadline - time.monotonic())))
        where = self.phases.current
        after = f" (rank(s) {', '.join(map(str, gone))} gone)" if gone else ""
        leave(f"rank {self.phases.rank} was in {where} when the launcher stopped it{after}.", 143)

    def agree(self, finite: bool) -> tuple[bool, list[int]]:
        """(stop asked on any rank, ranks whose loss is not finite)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(world + 1)
        flags[0] = 1.0 if self.asked else 0.0
        flags[1 + rank] = 0.0 if finite else 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.agreed = bool(flags[0])
        return self.agreed, [r for r in range(world) if flags[1 + r] > 0]
