"""The process groups of a tensor x pipeline x data-parallel job, built
once and passed to the plugins that need them, instead of module-level
caches (a cache keyed by a group's ``id`` could hand a destroyed group's
successor the old groups)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from pc_comm import Coord, ParallelDims, Subgroups, make_subgroups

__all__ = ["ParallelLayout", "PipelineStageManager"]


@dataclass
class ParallelLayout:
    """This rank's data-, pipeline- and tensor-parallel groups (from
    ``pc_comm.make_subgroups``: tp innermost), and further groups over
    given ranks made on demand (the pipeline's tied weights)."""

    groups: Subgroups
    # Groups over explicit global ranks, by those ranks; every rank makes
    # each one (new_group is collective), in the same order.
    extra: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # Ulysses sequence parallelism: the data-parallel ranks of one model
    # replica split in blocks of sp consecutive ranks; each block shares a
    # batch (its sequence split among them), the blocks read different ones.
    sp: int = 1
    sp_group: dist.ProcessGroup | None = None
    data_group: dist.ProcessGroup | None = None
    # Expert parallelism: the data-parallel ranks split in blocks of ep
    # consecutive ranks, each block holding every expert once (ep_group);
    # the ranks at the same place in each block hold the same experts and
    # average their gradients (expert_data_group).
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None
    expert_data_group: dist.ProcessGroup | None = None

    @staticmethod
    def build(tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1) -> ParallelLayout:
        """Collective over the default group: every rank calls it with the same sizes."""
        layout = ParallelLayout(make_subgroups(pp_size=pp, tp_size=tp), sp=sp, ep=ep)
        if ep > 1:
            layout.ep_group, layout.expert_data_group = layout._blocks("ep_size", ep)
        if sp > 1:
            layout.sp_group, layout.data_group = layout._blocks("sp_size", sp)
        return layout

    def _blocks(
        self, what: str, size: int
    ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """This rank's groups when each model replica's data-parallel ranks
        are split in blocks of ``size`` consecutive ranks: its block, and
        the ranks at its place in every block. Collective: every rank makes
        every group, in the same order."""
        if self.dims.dp % size:
            raise ValueError(
                f"{what}={size} must divide the {self.dims.dp} data-parallel ranks of each "
                f"model replica (world {self.dims.world_size} / tp {self.dims.tp} / pp "
                f"{self.dims.pp})."
            )
        me, block_group, across_group = dist.get_rank(), None, None
        for ranks in self.dims.groups("dp"):
            for start in range(0, len(ranks), size):
                block = tuple(ranks[start : start + size])
                group = self.group_over(block)
                if me in block:
                    block_group = group
            for offset in range(size):
                across = tuple(ranks[offset::size])
                group = self.group_over(across)
                if me in across:
                    across_group = group
        return block_group, across_group

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
        """Every data-parallel rank of this replica, the sequence-parallel
        ones too: the group gradients are averaged over."""
        return self.groups.dp

    @property
    def batch_group(self) -> dist.ProcessGroup:
        """The ranks that read different batches (without Ulysses, the
        data-parallel group): what the dataloader samples by."""
        return self.data_group if self.data_group is not None else self.groups.dp

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


@dataclass(frozen=True)
class PipelineStageManager:
    """Where this rank sits in the pipeline (``plugin.stage_manager``):
    ``stage`` (this rank's stage, 0-based),
    ``num_stages``, ``is_first_stage()``, ``is_last_stage()``, the
    neighbouring ranks and the pipeline's group."""

    pp_group: dist.ProcessGroup
    num_model_chunks: int = 1

    @property
    def stage(self) -> int:
        return dist.get_rank(self.pp_group)

    @property
    def num_stages(self) -> int:
        return dist.get_world_size(self.pp_group)

    @property
    def is_interleave(self) -> bool:
        return self.num_model_chunks > 1

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        """This rank holds the first stage (the model's input side)."""
        return self.stage == 0

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        """This rank holds the last stage (it computes the loss)."""
        return self.stage == self.num_stages - 1

    @property
    def prev_rank(self) -> int:
        """The global rank of the previous stage (wrapping around)."""
        return dist.get_global_rank(self.pp_group, (self.stage - 1) % self.num_stages)

    @property
    def next_rank(self) -> int:
        """The global rank of the next stage (wrapping around)."""
        return dist.get_global_rank(self.pp_group, (self.stage + 1) % self.num_stages)
