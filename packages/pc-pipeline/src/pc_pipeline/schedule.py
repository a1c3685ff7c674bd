"""A schedule is data: for each rank, the ordered actions it runs.

[Note: communication semantics]
The executor posts every send and every receive asynchronously when it
reaches the action, and waits for a received tensor only at the compute
action that consumes it (sends are waited for at the end of the step). So a
send or receive never blocks a rank; only a compute action can, while its
input has not been sent yet. Messages between one pair of ranks are matched
first-in first-out (NCCL's rule, and gloo's with a single tag): the k-th
receive a rank posts from a peer gets the k-th tensor that peer sent it.
:func:`with_communication` places receives so that this holds; validation
checks it, and simulation finds deadlocks under exactly these rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pc_pipeline.actions import Action, ActionKind

__all__ = [
    "Schedule",
    "ScheduleError",
    "check_structure",
    "format_grid",
    "local_prerequisites",
    "schedule_error",
    "with_communication",
]

F, B, I, W = (  # noqa: E741 (I is the schedule letter for an input gradient)
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one pipeline step.

    ``stage_rank[s]`` is the rank that runs stage ``s``; ``actions[r]`` is
    rank ``r``'s list in execution order.
    """

    name: str
    num_microbatches: int
    stage_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False  # evaluation: forwards and their sends only

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def compute_only(self) -> Schedule:
        """The same schedule without its sends and receives."""
        return Schedule(
            self.name,
            self.num_microbatches,
            self.stage_rank,
            tuple(tuple(a for a in acts if a.kind.is_compute) for acts in self.actions),
            self.forward_only,
        )

    def forwards(self) -> Schedule:
        """The forward-only schedule for evaluation: this schedule's forwards
        in the same order, with their sends and receives."""
        return with_communication(
            Schedule(
                f"{self.name} (forward only)",
                self.num_microbatches,
                self.stage_rank,
                tuple(
                    tuple(a for a in acts if a.kind is ActionKind.FORWARD) for acts in self.actions
                ),
                forward_only=True,
            )
        )

    def __str__(self) -> str:
        return format_grid(self)


class ScheduleError(ValueError):
    """A schedule that cannot run; the message holds the step x rank grid
    with the failing actions marked."""


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """The step x rank grid; cells ``(rank, step)`` in ``marks`` show as ``>x<``."""
    marked = set(marks)
    columns = []
    for rank, acts in enumerate(schedule.actions):
        cells = [f">{a}<" if (rank, i) in marked else str(a) for i, a in enumerate(acts)]
        columns.append([f"rank {rank}", *cells])
    height = max(len(c) for c in columns)
    widths = [max(len(x) for x in c) for c in columns]
    lines = []
    for row in range(height):
        label = "step" if row == 0 else str(row - 1)
        cells = [(c[row] if row < len(c) else "").ljust(widths[k]) for k, c in enumerate(columns)]
        lines.append(f"{label:>5}  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def schedule_error(
    schedule: Schedule, message: str, marks: Sequence[tuple[int, int]]
) -> ScheduleError:
    where = ", ".join(f"rank {r} step {i} ({schedule.actions[r][i]})" for r, i in marks)
    return ScheduleError(
        f"schedule {schedule.name!r} is invalid: {message}\n"
        f"failing: {where or 'see message'}\n{format_grid(schedule, marks)}"
    )


def _crosses(schedule: Schedule, stage: int, next_stage: int) -> bool:
    return schedule.stage_rank[stage] != schedule.stage_rank[next_stage]


def needs_messages(schedule: Schedule) -> list[tuple[Action, Action]]:
    """Every (send, receive) pair the schedule must contain."""
    pairs = []
    last = schedule.num_stages - 1
    for m in range(schedule.num_microbatches):
        for s in range(last):
            if _crosses(schedule, s, s + 1):
                pairs.append((Action(s, ActionKind.SEND_F, m), Action(s + 1, ActionKind.RECV_F, m)))
                if schedule.forward_only:
                    continue
                pairs.append((Action(s + 1, ActionKind.SEND_B, m), Action(s, ActionKind.RECV_B, m)))
    return pairs


def local_prerequisites(schedule: Schedule, action: Action) -> list[Action]:
    """What must run earlier on the same rank before ``action`` (one of the
    listed alternatives for a backward's output gradient is enough; see
    :func:`_satisfied`)."""
    s, kind, m = action
    last = schedule.num_stages - 1
    if kind is F:
        if s == 0:
            return []
        if _crosses(schedule, s - 1, s):
            return [Action(s, ActionKind.RECV_F, m)]
        return [Action(s - 1, F, m)]
    if kind in (B, I):
        needs = [Action(s, F, m)]
        if s < last:
            if _crosses(schedule, s, s + 1):
                needs.append(Action(s, ActionKind.RECV_B, m))
            else:
                needs.append(Action(s + 1, B, m))  # or I: see _satisfied
        return needs
    if kind is W:
        return [Action(s, I, m)]
    if kind is ActionKind.SEND_F:
        return [Action(s, F, m)]
    if kind is ActionKind.SEND_B:
        return [Action(s, B, m)]  # or I
    return []  # receives only post a buffer


def _satisfied(need: Action, done: set[Action]) -> bool:
    if need.kind is B:
        return need in done or Action(need.stage, I, need.microbatch) in done
    return need in done


def _check_ownership(schedule: Schedule) -> None:
    s_count, m_count = schedule.num_stages, schedule.num_microbatches
    if len(set(schedule.stage_rank)) != schedule.num_ranks or any(
        not 0 <= r < schedule.num_ranks for r in schedule.stage_rank
    ):
        raise ScheduleError(
            f"schedule {schedule.name!r}: stage_rank {schedule.stage_rank} must map stages "
            f"onto every one of the {schedule.num_ranks} ranks."
        )
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < s_count and 0 <= a.microbatch < m_count):
                raise schedule_error(
                    schedule,
                    f"{a} is out of range ({s_count} stages, {m_count} microbatches).",
                    [(rank, i)],
                )
            if schedule.stage_rank[a.stage] != rank:
                raise schedule_error(
                    schedule,
                    f"{a} runs on rank {rank}, but stage {a.stage} belongs to rank "
                    f"{schedule.stage_rank[a.stage]}.",
                    [(rank, i)],
                )


def _check_counts(schedule: Schedule) -> None:
    where: dict[Action, list[tuple[int, int]]] = {}
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            where.setdefault(a, []).append((rank, i))
    for a, places in where.items():
        if len(places) > 1:
            raise schedule_error(schedule, f"{a} appears {len(places)} times.", places)
    required = {pair[k] for pair in needs_messages(schedule) for k in (0, 1)}
    for a, places in where.items():
        if not a.kind.is_compute and a not in required:
            raise schedule_error(
                schedule,
                f"{a} has no counterpart: stages {a.stage} and {a.peer_action().stage} "
                "do not exchange this message (same rank, or no such stage).",
                places,
            )
    for send, recv in needs_messages(schedule):
        for a, other in ((send, recv), (recv, send)):
            if a not in where:
                marks = where.get(other, [])
                raise schedule_error(schedule, f"{other} has no matching {a}.", marks)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            has = {k: Action(s, k, m) in where for k in (F, B, I, W)}
            rank = schedule.stage_rank[s]
            if not has[F]:
                raise schedule_error(
                    schedule, f"stage {s} never runs the forward of microbatch {m}.", []
                )
            if schedule.forward_only:
                extra = [p for k in (B, I, W) for p in where.get(Action(s, k, m), [])]
                if extra:
                    raise schedule_error(schedule, "a forward-only schedule has backwards.", extra)
                continue
            whole = has[B] and not has[I] and not has[W]
            split = has[I] and has[W] and not has[B]
            if not (whole or split):
                found = [str(Action(s, k, m)) for k in (B, I, W) if has[k]]
                raise schedule_error(
                    schedule,
                    f"stage {s} (rank {rank}) microbatch {m} needs one backward: B, or I then "
                    f"W; found {found or 'none'}.",
                    [p for k in (B, I, W) for p in where.get(Action(s, k, m), [])],
                )


def _check_order(schedule: Schedule) -> None:
    for rank, acts in enumerate(schedule.actions):
        done: set[Action] = set()
        for i, a in enumerate(acts):
            for need in local_prerequisites(schedule, a):
                if not _satisfied(need, done):
                    raise schedule_error(
                        schedule, f"{a} runs before {need}, which it depends on.", [(rank, i)]
                    )
            done.add(a)


def _check_fifo(schedule: Schedule) -> None:
    """The k-th receive a rank posts from a peer must be the k-th send of that
    peer to it [Note: communication semantics]."""
    sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    rank_of = schedule.stage_rank
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind.is_send:
                sends.setdefault((rank, rank_of[a.peer_action().stage]), []).append((i, a))
            elif a.kind.is_recv:
                recvs.setdefault((rank_of[a.peer_action().stage], rank), []).append((i, a))
    for (src, dst), sent in sends.items():
        got = recvs.get((src, dst), [])
        for (i, send), (j, recv) in zip(sent, got, strict=False):
            if send.peer_action() != recv:
                raise schedule_error(
                    schedule,
                    f"rank {src}'s sends to rank {dst} and rank {dst}'s receives from rank "
                    f"{src} are in different orders: {send} would be received by {recv} "
                    "(messages between two ranks are matched first in, first out).",
                    [(src, i), (dst, j)],
                )


def check_structure(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` (with the grid) unless stages run on
    their ranks, each forward and backward appears exactly once, each
    backward after its forward, and sends match receives in order. Whether
    the schedule deadlocks needs a simulation: :func:`pc_pipeline.validate`
    checks both."""
    _check_ownership(schedule)
    _check_counts(schedule)
    _check_order(schedule)
    _check_fifo(schedule)


def with_communication(schedule: Schedule) -> Schedule:
    """Insert the sends and receives a compute-only schedule needs.

    A send goes right after the action that produces its tensor. A receive
    goes two compute actions before the one that consumes it, or earlier
    where the first-in first-out rule demands it [Note: communication
    semantics].
    """
    compute = schedule.compute_only().actions
    rank_of = schedule.stage_rank
    last = schedule.num_stages - 1
    sends_after: list[dict[int, list[Action]]] = [{} for _ in compute]
    message_order: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> receives
    for rank, acts in enumerate(compute):
        for i, a in enumerate(acts):
            out: list[Action] = []
            if a.kind is F and a.stage < last and rank_of[a.stage + 1] != rank:
                out.append(Action(a.stage, ActionKind.SEND_F, a.microbatch))
            if a.kind in (B, I) and a.stage > 0 and rank_of[a.stage - 1] != rank:
                out.append(Action(a.stage, ActionKind.SEND_B, a.microbatch))
            for send in out:
                message_order.setdefault((rank, rank_of[send.peer_action().stage]), []).append(
                    send.peer_action()
                )
            if out:
                sends_after[rank][i] = out
    recvs_before: list[dict[int, list[Action]]] = [{} for _ in compute]
    for (_, dst), receives in sorted(message_order.items()):
        index = {a: i for i, a in enumerate(compute[dst])}
        positions: list[int] = []
        latest = len(compute[dst])
        for recv in reversed(receives):
            consumer = _consumer(recv)
            if consumer not in index and consumer.kind is B:
                consumer = Action(consumer.stage, I, consumer.microbatch)
            if consumer not in index:
                raise schedule_error(
                    schedule, f"nothing on rank {dst} consumes {recv} (missing {consumer}).", []
                )
            # Two compute actions ahead of its consumer, so the transfer
            # overlaps them (gloo and NCCL move data only once the receive
            # is posted); it costs at most two early receive buffers.
            latest = min(latest, max(index[consumer] - 2, 0))
            positions.append(latest)
        for recv, pos in zip(reversed(receives), positions, strict=True):
            recvs_before[dst].setdefault(pos, []).insert(0, recv)
    actions = []
    for rank, acts in enumerate(compute):
        out_list: list[Action] = []
        for i, a in enumerate(acts):
            out_list += recvs_before[rank].get(i, [])
            out_list.append(a)
            out_list += sends_after[rank].get(i, [])
        actions.append(tuple(out_list))
    return Schedule(
        schedule.name,
        schedule.num_microbatches,
        schedule.stage_rank,
        tuple(actions),
        schedule.forward_only,
    )


def _consumer(recv: Action) -> Action:
    if recv.kind is ActionKind.RECV_F:
        return Action(recv.stage, F, recv.microbatch)
    return Action(recv.stage, B, recv.microbatch)
