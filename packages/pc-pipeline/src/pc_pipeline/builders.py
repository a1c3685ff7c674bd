"""Schedule builders: each is a short function that lists actions.

Stage ``s`` runs on rank ``s % num_ranks``; with one model chunk per rank
that is rank ``s``. Every builder returns a validated schedule with its
sends and receives in place.
"""

from __future__ import annotations

from pc_pipeline.actions import Action, ActionKind
from pc_pipeline.schedule import Schedule, with_communication
from pc_pipeline.validation import validate

__all__ = ["gpipe", "interleaved_1f1b", "one_f_one_b", "zero_bubble_h1"]

F, B, I, W = (  # noqa: E741
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


def _check(name: str, num_ranks: int, num_microbatches: int, minimum: int) -> None:
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive int, got {value!r}.")
    if num_microbatches < minimum:
        raise ValueError(
            f"{name} needs at least {minimum} microbatches for {num_ranks} ranks, got "
            f"{num_microbatches}; raise chunks to {minimum} or more (more microbatches "
            "also shrink the bubble)."
        )


def _finish(name: str, m: int, ranks: int, stages: int, lists: list[list[Action]]) -> Schedule:
    stage_rank = tuple(s % ranks for s in range(stages))
    schedule = with_communication(
        Schedule(name, m, stage_rank, tuple(tuple(acts) for acts in lists))
    )
    validate(schedule)
    return schedule


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe). Every rank holds every
    microbatch's activations at the turn."""
    _check("gpipe", num_ranks, num_microbatches, 1)
    m = num_microbatches
    lists = [
        [Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]
        for r in range(num_ranks)
    ]
    return _finish("gpipe", m, num_ranks, num_ranks, lists)


def _one_f_one_b_order(rank: int, ranks: int, m: int) -> list[tuple[ActionKind, int]]:
    """PipeDream-flush: ``ranks - rank - 1`` warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    warmup = min(ranks - rank - 1, m)
    order: list[tuple[ActionKind, int]] = [(F, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i), (B, i)]
    order += [(B, i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): the bubble of GPipe, but rank ``r`` holds at
    most ``num_ranks - r`` microbatches' activations."""
    _check("1f1b", num_ranks, num_microbatches, num_ranks)
    lists = [
        [Action(r, kind, i) for kind, i in _one_f_one_b_order(r, num_ranks, num_microbatches)]
        for r in range(num_ranks)
    ]
    return _finish("1f1b", num_microbatches, num_ranks, num_ranks, lists)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, num_model_chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each rank holds ``num_model_chunks``
    stages, ``s = chunk * num_ranks + rank``, and the bubble shrinks by that
    factor. Microbatches go through a rank's chunks in groups of
    ``num_ranks``, so ``num_microbatches`` must be a multiple of it."""
    p, m, v = num_ranks, num_microbatches, num_model_chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"interleaved_1f1b: num_model_chunks must be a positive int, got {v!r}.")
    _check("interleaved_1f1b", p, m, p)
    if m % p:
        raise ValueError(
            f"interleaved_1f1b: num_microbatches ({m}) must be a multiple of num_ranks ({p}); "
            f"use {m - m % p} or {m + p - m % p}."
        )

    def forward_slot(k: int) -> tuple[int, int]:
        chunk = (k // p) % v
        return chunk, (k // (p * v)) * p + k % p

    def backward_slot(k: int) -> tuple[int, int]:
        chunk, mb = forward_slot(k)
        return v - 1 - chunk, mb

    total = m * v
    lists = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts: list[Action] = []
        for k in range(warmup):
            chunk, mb = forward_slot(k)
            acts.append(Action(chunk * p + r, F, mb))
        for k in range(total - warmup):
            chunk, mb = forward_slot(warmup + k)
            acts.append(Action(chunk * p + r, F, mb))
            chunk, mb = backward_slot(k)
            acts.append(Action(chunk * p + r, B, mb))
        for k in range(total - warmup, total):
            chunk, mb = backward_slot(k)
            acts.append(Action(chunk * p + r, B, mb))
        lists.append(acts)
    return _finish("interleaved_1f1b", m, p, p * v, lists)


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero-bubble pipeline, Qi et al. 2023): 1F1B with each backward
    split into the input gradient ``I``, which the previous stage waits for,
    and the weight gradient ``W``, which nobody waits for. Rank ``r`` runs
    its first ``r`` weight gradients late, in the tail where 1F1B would
    idle; its activations peak at ``num_ranks``, as on 1F1B's first rank."""
    _check("zb_h1", num_ranks, num_microbatches, num_ranks)
    p, m = num_ranks, num_microbatches
    lists = []
    for r in range(p):
        delay = r  # weight gradients held back on this rank
        acts: list[Action] = []
        weights_done = 0
        inputs_done = 0
        for kind, i in _one_f_one_b_order(r, p, m):
            if kind is F:
                acts.append(Action(r, F, i))
                continue
            acts.append(Action(r, I, i))
            inputs_done += 1
            if inputs_done > delay:
                acts.append(Action(r, W, weights_done))
                weights_done += 1
        acts += [Action(r, W, i) for i in range(weights_done, m)]
        lists.append(acts)
    return _finish("zb_h1", m, p, p, lists)
