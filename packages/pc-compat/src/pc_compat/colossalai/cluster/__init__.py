"""``colossalai.cluster``: ``DistCoordinator``; ``ProcessGroupMesh`` refused
with pc's way to build groups."""

from __future__ import annotations

from pc_compat.colossalai.cluster._coordinator import DistCoordinator
from pc_compat.surface import refused_class

__all__ = ["DistCoordinator", "ProcessGroupMesh"]

ProcessGroupMesh = refused_class(
    "colossalai.cluster",
    "ProcessGroupMesh",
    "pc builds its process groups from one layout: pc_comm.ParallelDims / make_subgroups, or "
    "a plugin's layout (HybridParallelPlugin(...).pg_mesh is a pc_booster.ParallelLayout "
    "with dp_group, tp_group and pp_group).",
)
