"""ParallelDims arithmetic (pure) and make_subgroups on a real 4-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pc_comm import Coord, ParallelDims, TorchCommunicator, make_subgroups
from pc_comm.testing import spawn

pytestmark = pytest.mark.timeout(120)


def test_invalid_degrees_raise_with_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"dp\(2\) \* pp\(2\) \* tp\(2\) = 8 != world_size\(4\)"):
        ParallelDims(dp=2, pp=2, tp=2, world_size=4)
    with pytest.raises(
        ValueError, match=r"world_size\(6\) is not divisible by pp\(2\) \* tp\(2\) = 4"
    ):
        ParallelDims.infer(6, pp=2, tp=2)
    with pytest.raises(ValueError, match="tp must be at least 1, got 0"):
        ParallelDims(dp=4, pp=1, tp=0, world_size=4)
    with pytest.raises(TypeError, match="pp must be an int"):
        ParallelDims(dp=4, pp=1.0, tp=1, world_size=4)  # type: ignore[arg-type]


def test_rank_layout_is_tp_innermost_then_pp_then_dp() -> None:
    dims = ParallelDims(dp=2, pp=2, tp=2, world_size=8)
    assert [dims.coord_of(r) for r in range(4)] == [
        Coord(0, 0, 0),
        Coord(0, 0, 1),
        Coord(0, 1, 0),
        Coord(0, 1, 1),
    ]
    assert all(dims.rank_of(dims.coord_of(r)) == r for r in range(8))
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\)"):
        dims.coord_of(8)
    with pytest.raises(ValueError, match="dim must be one of"):
        dims.groups("ep")


def test_haiscale_layout_with_tp_1_has_contiguous_pipelines() -> None:
    dims = ParallelDims.infer(8, pp=4)
    assert dims.groups("pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _members(group: dist.ProcessGroup) -> list[int]:
    comm = TorchCommunicator(group)
    out = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(out, torch.tensor([dist.get_rank()]))
    return out.tolist()


def _check_subgroups() -> None:
    rank = dist.get_rank()
    # dp2 x pp2, unpacked the haiscale way.
    dp_group, pp_group = make_subgroups(pp_size=2)
    dims = ParallelDims(dp=2, pp=2, tp=1, world_size=4)
    expected_pp = next(g for g in dims.groups("pp") if rank in g)
    expected_dp = next(g for g in dims.groups("dp") if rank in g)
    assert _members(pp_group) == expected_pp, (_members(pp_group), expected_pp)
    assert _members(dp_group) == expected_dp

    # dp2 x tp2: three groups, and the tp group is a singleton-free pair.
    groups = make_subgroups(tp_size=2)
    dp_group, pp_group, tp_group = groups
    assert groups.coord == ParallelDims(dp=2, pp=1, tp=2, world_size=4).coord_of(rank)
    assert _members(tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _members(dp_group) == [rank % 2, rank % 2 + 2]
    assert _members(pp_group) == [rank]

    with pytest.raises(ValueError, match=r"dp_size\(3\) \* pp_size\(2\) \* tp_size\(1\) = 6"):
        make_subgroups(pp_size=2, dp_size=3)
    with pytest.raises(ValueError, match="not divisible"):
        make_subgroups(pp_size=3)


def test_make_subgroups_on_four_ranks() -> None:
    spawn(_check_subgroups, 4, timeout=90)
