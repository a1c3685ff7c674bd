"""Whether a schedule can run: its structure (pc_pipeline.schedule) and
freedom from deadlock, which the simulation (pc_pipeline.simulate) finds
under exactly the executor's communication rules [Note: communication
semantics]."""

from __future__ import annotations

from pc_pipeline.schedule import Schedule, check_structure
from pc_pipeline.simulate import Costs, simulate

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Raise :class:`~pc_pipeline.ScheduleError` (with the grid) unless the
    schedule can run: stages on their ranks, each forward and backward
    exactly once, each backward after its forward, sends matching receives
    in order, and no deadlock."""
    check_structure(schedule)
    simulate(schedule, Costs(), validate_first=False)
