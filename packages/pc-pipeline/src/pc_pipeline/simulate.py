"""Run a schedule on paper: when each action starts and ends, how much of
the step each rank sits idle (the bubble), and how many microbatches' activations
each rank holds at its peak.

Ranks run their actions in order. A compute action starts when the rank is
free and its input is there: a tensor from another rank arrives ``latency``
after the sender reached its send [Note: communication semantics]. Sends
and receives take no rank time. If no rank can move and some have actions
left, the schedule deadlocks, which :class:`ScheduleError` reports with the
blocked actions marked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pc_pipeline.actions import Action, ActionKind
from pc_pipeline.schedule import Schedule, check_structure, local_prerequisites, schedule_error

__all__ = ["Costs", "Simulation", "Span", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Time of each action kind, in any unit. ``backward`` is a whole
    backward (``I`` + ``W``). ``per_action``, if given, overrides them for
    every compute action, e.g. with measured per-stage times."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0
    per_action: Callable[[Action], float] | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name} must be >= 0, got {getattr(self, name)}.")

    def of(self, action: Action) -> float:
        kind = action.kind
        if not kind.is_compute:
            return 0.0
        if self.per_action is not None:
            return self.per_action(action)
        return {
            ActionKind.FORWARD: self.forward,
            ActionKind.BACKWARD: self.backward,
            ActionKind.BACKWARD_INPUT: self.backward_input,
            ActionKind.BACKWARD_WEIGHT: self.backward_weight,
        }.get(kind, 0.0)


@dataclass(frozen=True)
class Span:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """``bubble_fraction`` is idle time over ``num_ranks * makespan``;
    ``bubble_ratio`` is idle time over busy time (the form in which the
    interleaved schedule divides the bubble by the number of chunks)."""

    schedule: Schedule
    costs: Costs
    spans: tuple[tuple[Span, ...], ...]  # per rank, compute actions only
    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]

    @property
    def idle(self) -> float:
        return sum(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * len(self.busy)
        return self.idle / total if total else 0.0

    @property
    def bubble_ratio(self) -> float:
        busy = sum(self.busy)
        return self.idle / busy if busy else 0.0


def _ready_time(
    schedule: Schedule, action: Action, done: dict[Action, float], costs: Costs
) -> float | None:
    """When ``action``'s inputs from other ranks are there, or None if a
    sender has not reached its send yet. Local prerequisites are already
    known to be done (validation checked the order)."""
    if not action.kind.is_compute:
        return 0.0
    ready = 0.0
    for need in local_prerequisites(schedule, action):
        if need.kind.is_recv:
            send = need.peer_action()
            if send not in done:
                return None
            ready = max(ready, done[send] + costs.latency)
        else:
            if need.kind is ActionKind.BACKWARD and need not in done:
                need = Action(need.stage, ActionKind.BACKWARD_INPUT, need.microbatch)
            ready = max(ready, done[need])
    return ready


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, validate_first: bool = True
) -> Simulation:
    """Timeline, bubble and peak activations of ``schedule`` under ``costs``
    (default: forward 1, backward 2, split backward 1 + 1, no latency).

    ``validate_first``: check the structure first (:func:`check_structure`);
    a deadlock is found by the simulation itself, under any costs, since
    whether a rank can move depends only on which sends have happened."""
    costs = costs or Costs()
    if validate_first:
        check_structure(schedule)
    ranks = schedule.num_ranks
    pos = [0] * ranks
    clock = [0.0] * ranks
    done: dict[Action, float] = {}  # action -> end time (sends: time reached)
    spans: list[list[Span]] = [[] for _ in range(ranks)]
    live = [0] * ranks
    peak = [0] * ranks
    while True:
        progressed = False
        for r in range(ranks):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                action = acts[pos[r]]
                ready = _ready_time(schedule, action, done, costs)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + costs.of(action)
                done[action] = end
                clock[r] = end
                pos[r] += 1
                progressed = True
                if action.kind.is_compute:
                    spans[r].append(Span(action, start, end))
                if action.kind is ActionKind.FORWARD:
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                    live[r] -= 1
        if all(pos[r] == len(schedule.actions[r]) for r in range(ranks)):
            break
        if not progressed:
            blocked = [(r, pos[r]) for r in range(ranks) if pos[r] < len(schedule.actions[r])]
            waits = "; ".join(f"rank {r} waits at {schedule.actions[r][i]}" for r, i in blocked)
            raise schedule_error(schedule, f"deadlock: no rank can proceed ({waits}).", blocked)
    makespan = max(clock, default=0.0)
    busy = tuple(sum(s.end - s.start for s in rank_spans) for rank_spans in spans)
    return Simulation(schedule, costs, tuple(tuple(s) for s in spans), makespan, busy, tuple(peak))
