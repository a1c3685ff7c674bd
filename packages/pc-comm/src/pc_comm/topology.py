"""Parallel degrees, the rank-to-coordinate mapping, and the subgroups.

Rank layout
-----------
A rank's coordinate is ``(dp, pp, tp)`` and ranks are laid out with tensor
parallelism innermost, then pipeline, then data parallelism outermost::

    rank = (dp_index * pp + pp_index) * tp + tp_index

Why this order: tensor parallelism moves the most data per step (activations
on every layer), so its ranks are adjacent and share a node's fastest links;
pipeline stages exchange only boundary activations; the data-parallel
gradient reduction happens once per step and spans nodes hierarchically.
With ``tp = 1`` the layout is haiscale's: consecutive ranks form one
pipeline. Example, 8 ranks with dp=2, pp=2, tp=2::

    rank:  0 1 2 3 4 5 6 7
    dp:    0 0 0 0 1 1 1 1
    pp:    0 0 1 1 0 0 1 1
    tp:    0 1 0 1 0 1 0 1
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

__all__ = ["Coord", "ParallelDims", "Subgroups", "make_subgroups", "two_level_groups"]


class Coord(NamedTuple):
    """A rank's position along each parallel dimension."""

    dp: int
    pp: int
    tp: int


def _check_degree(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")


@dataclass(frozen=True)
class ParallelDims:
    """Data, pipeline and tensor parallel degrees of a job.

    ``dp * pp * tp`` must equal ``world_size``. Use :meth:`infer` to derive
    ``dp`` from the world size.
    """

    dp: int
    pp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "world_size"):
            _check_degree(name, getattr(self, name))
        if self.dp * self.pp * self.tp != self.world_size:
            raise ValueError(
                f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) = "
                f"{self.dp * self.pp * self.tp} != world_size({self.world_size}); "
                "choose degrees whose product is the number of ranks."
            )

    @classmethod
    def infer(cls, world_size: int, *, pp: int = 1, tp: int = 1) -> ParallelDims:
        """Degrees with ``dp = world_size / (pp * tp)``."""
        for name, value in (("world_size", world_size), ("pp", pp), ("tp", tp)):
            _check_degree(name, value)
        if world_size % (pp * tp) != 0:
            raise ValueError(
                f"world_size({world_size}) is not divisible by pp({pp}) * tp({tp}) = "
                f"{pp * tp}, so no data-parallel degree fits; "
                f"use pp * tp in {_divisors(world_size)}."
            )
        return cls(dp=world_size // (pp * tp), pp=pp, tp=tp, world_size=world_size)

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}.")
        tp_index = rank % self.tp
        pp_index = (rank // self.tp) % self.pp
        dp_index = rank // (self.tp * self.pp)
        return Coord(dp=dp_index, pp=pp_index, tp=tp_index)

    def rank_of(self, coord: Coord) -> int:
        for name, index, size in zip(
            Coord._fields, coord, (self.dp, self.pp, self.tp), strict=True
        ):
            if not 0 <= index < size:
                raise ValueError(f"{name} index must be in [0, {size}), got {index}.")
        return (coord.dp * self.pp + coord.pp) * self.tp + coord.tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``dim`` ("dp", "pp" or
        "tp"), each in increasing coordinate order along ``dim``."""
        if dim not in Coord._fields:
            raise ValueError(f"dim must be one of {Coord._fields}, got {dim!r}.")
        axis = Coord._fields.index(dim)
        sizes = (self.dp, self.pp, self.tp)
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coord = self.coord_of(rank)
            key = tuple(c for i, c in enumerate(coord) if i != axis)
            found.setdefault(key, []).append(rank)
        result = list(found.values())
        assert all(len(g) == sizes[axis] for g in result), "groups of unequal size"
        return result


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Subgroups:
    """This rank's process groups along each dimension, and where it sits.

    Unpacks like haiscale's ``make_subgroups``: ``dp_group, pp_group =
    make_subgroups(pp_size=2)``; when ``tp > 1`` it unpacks to three groups,
    ``dp_group, pp_group, tp_group``.
    """

    dims: ParallelDims
    coord: Coord
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup

    def __iter__(self) -> Iterator[dist.ProcessGroup]:
        yield self.dp
        yield self.pp
        if self.dims.tp > 1:
            yield self.tp


def make_subgroups(
    pp_size: int = 1,
    tp_size: int = 1,
    dp_size: int | None = None,
) -> Subgroups:
    """Split the default process group into data, pipeline and tensor
    parallel subgroups (layout in this module's docstring).

    Every rank must call it, with the same arguments, after the default group
    is initialised. ``dp_size`` defaults to ``world_size / (pp_size *
    tp_size)``; if given it must match.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "make_subgroups needs the default process group; call "
            "pc_comm.init_distributed() (or dist.init_process_group) first."
        )
    world_size = dist.get_world_size()
    dims = ParallelDims.infer(world_size, pp=pp_size, tp=tp_size)
    if dp_size is not None and dp_size != dims.dp:
        raise ValueError(
            f"dp_size({dp_size}) * pp_size({pp_size}) * tp_size({tp_size}) = "
            f"{dp_size * pp_size * tp_size} != world_size({world_size}); "
            f"leave dp_size out to use {dims.dp}."
        )
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    # new_group is collective over the default group: every rank creates
    # every group, in the same order, and keeps the one it belongs to.
    for dim in Coord._fields:
        for ranks in dims.groups(dim):
            group = dist.new_group(ranks)
            if rank in ranks:
                assert group is not None, "new_group returned None for a member"
                mine[dim] = group
    return Subgroups(
        dims=dims, coord=dims.coord_of(rank), dp=mine["dp"], pp=mine["pp"], tp=mine["tp"]
    )


def two_level_groups(
    replicas: int, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Collective: ``group``'s ranks (default: every rank) split for
    two-level sharding into ``replicas`` shard groups of consecutive ranks
    (with torchrun's node-major ranks, the ranks of a node when the shard
    size divides the ranks per node) and the replica groups across them
    (the ranks at the same place in each shard group). Returns this rank's
    (shard group, replica group)."""
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}.")
    if len(ranks) % replicas:
        raise ValueError(
            f"{replicas} replicas must divide the {len(ranks)} ranks; choose a divisor of "
            f"{len(ranks)}."
        )
    size = len(ranks) // replicas
    me = dist.get_rank()
    shard: dist.ProcessGroup | None = None
    replica: dist.ProcessGroup | None = None
    for k in range(replicas):  # every rank creates every group, in one order
        members = ranks[k * size : (k + 1) * size]
        made = dist.new_group(members)
        if me in members:
            shard = made
    for j in range(size):
        members = ranks[j::size]
        made = dist.new_group(members)
        if me in members:
            replica = made
    if shard is None or replica is None:
        raise ValueError(f"rank {me} is not in the group {ranks}; call it on its ranks only.")
    return shard, replica
