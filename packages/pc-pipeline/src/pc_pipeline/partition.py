"""Split an ``nn.Sequential`` into pipeline stages.

Stages are contiguous runs of layers. Stage ``s`` runs on rank
``s % world_size``, so with ``num_model_chunks = v`` rank ``r`` holds stages
``r, r + world_size, ...`` (the interleaved layout). The split minimises the
largest stage's cost: parameter count by default, or per-layer costs you
pass (for example from :func:`measure_costs`), or an explicit ``balance``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Sequential", "SequentialModel", "balanced_split", "measure_costs", "partition"]


class Sequential(nn.Sequential):
    """``nn.Sequential`` whose layers may return tuples: a tuple output is
    passed to the next layer as separate arguments, as between pipeline
    stages. Build the model with it when layers exchange several tensors."""

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for layer in self:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


# haiscale's name for the same container (``haiscale.pipeline.SequentialModel``).
SequentialModel = Sequential


def _fits(costs: Sequence[float], parts: int, cap: float) -> bool:
    used, load = 1, 0.0
    for c in costs:
        if c > cap:
            return False
        if load + c > cap:
            used, load = used + 1, c
        else:
            load += c
    return used <= parts


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts of ``parts`` non-empty contiguous groups whose largest
    total cost is as small as possible."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}.")
    if len(costs) < parts:
        raise ValueError(
            f"cannot split {len(costs)} layers into {parts} stages: a stage would be "
            f"empty. Use at most {len(costs)} stages (world_size * num_model_chunks), or "
            "split the model into more layers."
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {list(costs)}.")
    low, high = max(costs, default=0.0), float(sum(costs))
    for _ in range(100):
        if high - low <= 1e-9 * max(high, 1.0):
            break
        mid = (low + high) / 2
        if _fits(costs, parts, mid):
            high = mid
        else:
            low = mid
    # Greedy fill under the cap, leaving at least one layer per later stage.
    counts: list[int] = []
    i = 0
    for part in range(parts):
        left_parts = parts - part - 1
        load, count = 0.0, 0
        while i < len(costs) - left_parts and (count == 0 or load + costs[i] <= high):
            load += costs[i]
            count += 1
            i += 1
        counts.append(count)
    counts[-1] += len(costs) - i
    assert sum(counts) == len(costs), counts
    assert min(counts) >= 1, counts
    return counts


def measure_costs(
    module: nn.Sequential, *example_inputs: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Seconds of forward + backward of each layer on ``example_inputs``
    (the median of ``repeats``), to pass as ``partition(costs=...)``."""
    costs = []
    inputs: tuple[torch.Tensor, ...] = example_inputs
    for layer in module:
        times = []
        out: Any = None
        for _ in range(repeats):
            args = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
            start = time.perf_counter()
            out = layer(*args)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            loss = sum((t.float().sum() for t in outs if t.requires_grad), torch.zeros(()))
            if loss.requires_grad:
                loss.backward()
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        inputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        inputs = tuple(t.detach() for t in inputs)
    return costs


def partition(
    module: nn.Sequential,
    rank: int,
    world_size: int,
    num_model_chunks: int = 1,
    *,
    balance: Sequence[int] | None = None,
    costs: Sequence[float] | None = None,
) -> Sequential | list[Sequential]:
    """This rank's stage (or, with ``num_model_chunks > 1``, its list of
    stages, chunk ``c`` being stage ``c * world_size + rank``).

    ``balance`` gives the number of layers of every stage explicitly;
    otherwise layers are split to balance ``costs`` (default: each layer's
    parameter count, plus one so parameter-free layers still count).
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"partition expects an nn.Sequential, got {type(module).__name__}; express the "
            "model as a sequence of layers, each taking the previous one's output."
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}.")
    if num_model_chunks < 1:
        raise ValueError(f"num_model_chunks must be at least 1, got {num_model_chunks}.")
    layers = list(module)
    stages = world_size * num_model_chunks
    if balance is not None:
        counts = list(balance)
        if len(counts) != stages or sum(counts) != len(layers) or min(counts, default=0) < 1:
            raise ValueError(
                f"balance {counts} must list {stages} stage sizes (world_size {world_size} x "
                f"num_model_chunks {num_model_chunks}), each at least 1, summing to the "
                f"{len(layers)} layers."
            )
    else:
        if costs is None:
            costs = [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]
        if len(costs) != len(layers):
            raise ValueError(f"costs has {len(costs)} entries for {len(layers)} layers.")
        counts = balanced_split(costs, stages)
    starts = [sum(counts[:s]) for s in range(stages)]
    mine = [
        Sequential(*layers[starts[s] : starts[s] + counts[s]])
        for s in range(rank, stages, world_size)
    ]
    return mine[0] if num_model_chunks == 1 else mine
