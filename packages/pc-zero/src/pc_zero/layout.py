"""How ZeRO-1/2 lays a parameter group out in flat buckets and shards it.

[Note: layout]
The parameters of one optimizer param group (those requiring grad), in the
order their gradients are expected (reverse registration order), are packed
into buckets of whole parameters of up to ``bucket_numel`` elements. Each
bucket is padded to a multiple of the world size N and split evenly: rank r
owns elements ``[r * B/N, (r+1) * B/N)`` of a bucket of B elements, its
*piece*. A group's buckets sit back to back in one flat working buffer, and
every parameter is a view into it.

Why per bucket and not per group: a bucket's reduce-scatter is then an even
reduce-scatter whose input is a plain view of the bucket and whose output is
the rank's piece, with no copy in either direction, and the bucket can be
reduced the moment its last gradient arrives during backward. The rank's
optimizer steps one fp32 tensor per piece, so param groups stay distinct and
the optimizer state is as many tensors as buckets.

Checkpoints do not depend on this layout: they are written per parameter
(see :mod:`pc_zero.state`), so they load at any world size or bucket size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Bucket", "Slot", "plan_buckets"]


@dataclass(frozen=True)
class Slot:
    """A parameter's place: ``index`` in the optimizer's original parameter
    order, ``offset`` inside its bucket, ``numel`` and ``shape``."""

    index: int
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """Whole parameters of one group, padded to ``numel`` (a multiple of the
    world size). ``start`` is its offset in the group's flat buffer; ``piece``
    is the number of elements each rank owns; ``order`` is its place in the
    expected gradient-arrival order across all groups."""

    group: int
    start: int
    numel: int
    piece: int
    slots: tuple[Slot, ...]
    order: int = 0

    def piece_range(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of rank ``rank``'s piece, in bucket coordinates."""
        return rank * self.piece, (rank + 1) * self.piece


def plan_buckets(
    groups: list[list[tuple[int, torch.Size]]],
    bucket_numel: int,
    world_size: int,
    piece_multiple: int = 1,
) -> list[list[Bucket]]:
    """Buckets per group for parameters given as ``(index, shape)`` in
    arrival order (their ``index`` gives the arrival rank across groups).
    A parameter larger than ``bucket_numel`` gets a bucket of its own.
    Each rank's piece is a multiple of ``piece_multiple`` elements."""
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_numel}.")
    planned: list[list[Bucket]] = []
    for g, params in enumerate(groups):
        runs: list[list[Slot]] = [[]]
        used = 0
        for index, shape in params:
            numel = int(torch.Size(shape).numel())
            if runs[-1] and used + numel > bucket_numel:
                runs.append([])
                used = 0
            runs[-1].append(Slot(index, used, numel, torch.Size(shape)))
            used += numel
        buckets: list[Bucket] = []
        start = 0
        for run in runs:
            if not run:
                continue
            used = run[-1].offset + run[-1].numel
            unit = world_size * piece_multiple
            padded = max(1, -(-used // unit)) * unit
            buckets.append(Bucket(g, start, padded, padded // world_size, tuple(run)))
            start += padded
        planned.append(buckets)
    return planned
