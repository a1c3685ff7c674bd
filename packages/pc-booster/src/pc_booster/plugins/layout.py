"""The process groups of a tensor x pipeline x data-parallel job, built
once and passed to the plugins that need them, instead of module-level
caches (a cache keyed by a group's ``id`` could hand a destroyed group's
successor the old groups)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from pc_comm import Coord, ParallelDims, Subgroups, make_subgroups

__all__ = ["ParallelLayout"]


@dataclass
class ParallelLayout:
    """This rank's data-, pipeline- and tensor-parallel groups (from
    ``pc_comm.make_subgroups``: tp innermost), and further groups over
    given ranks made on demand (the pipeline's tied weights)."""

    groups: Subgroups
    # Groups over explicit global ranks, by those ranks; every rank makes
    # each one (new_group is collective), in the same order.
    extra: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @staticmethod
    def build(tp: int = 1, pp: int = 1) -> ParallelLayout:
        """Collective over the default group: every rank calls it with the same sizes."""
        return ParallelLayout(make_subgroups(pp_size=pp, tp_size=tp))

    @property
    def dims(self) -> ParallelDims:
        return self.groups.dims

    @property
    def coord(self) -> Coord:
        return self.groups.coord

    @property
    def tp_size(self) -> int:
        return self.groups.dims.tp

    @property
    def pp_size(self) -> int:
        return self.groups.dims.pp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups.dp

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.groups.pp

    def group_over(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """A group over ``ranks`` (global), made once. Collective: every
        rank calls it for the same ranks in the same order."""
        if ranks not in self.extra:
            group = dist.new_group(list(ranks))
            assert group is not None
            self.extra[ranks] = group
        return self.extra[ranks]
