"""``place_local_box``: where a box of a tensor-parallel shard lies in the
full tensor, checked against ``shard_tensor`` (the inverse of what
``unshard_tensor`` assembles) for every split kind: plain, fused parts,
vocabulary padding, ``Conv1D`` transposed. Pure index arithmetic, so no
process group: the rank and world are patched in."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_tensor import ShardSpec, full_shape, place_local_box, shard_tensor


def _shards(
    monkeypatch: pytest.MonkeyPatch,
    full: torch.Tensor,
    spec: ShardSpec,
    local: torch.Size,
    world: int,
) -> list[torch.Tensor]:
    out = []
    for rank in range(world):
        monkeypatch.setattr(dist, "get_world_size", lambda group: world)
        monkeypatch.setattr(dist, "get_rank", lambda group, rank=rank: rank)
        out.append(shard_tensor(full, spec, None, local))  # type: ignore[arg-type]
    return out


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ShardSpec, torch.Size, int]:
    world = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 2))
    dim = draw(st.integers(0, ndim - 1))
    padded = draw(st.booleans())
    parts = 1 if padded else draw(st.integers(1, 3))
    block = draw(st.integers(1, 4))
    local = [draw(st.integers(1, 5)) for _ in range(ndim)]
    local[dim] = block * parts
    size = None
    if padded:  # the real rows stop inside the last rank's shard
        size = draw(st.integers(max(1, block * (world - 1) + 1), block * world))
    transpose = ndim == 2 and draw(st.booleans())
    return ShardSpec(dim, parts, size, transpose), torch.Size(local), world


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data())
def test_every_local_box_lands_on_its_values(
    layout: tuple[ShardSpec, torch.Size, int], data: st.DataObject
) -> None:
    spec, local_shape, world = layout
    shape = full_shape(spec, local_shape, world)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
    with pytest.MonkeyPatch.context() as patch:
        shards = _shards(patch, full, spec, local_shape, world)
    covered = torch.zeros(shape)
    for rank, local in enumerate(shards):
        whole = tuple(0 for _ in local_shape), tuple(local_shape)
        box_offsets = tuple(data.draw(st.integers(0, s - 1)) for s in local_shape)
        box_sizes = tuple(
            data.draw(st.integers(1, s - o)) for o, s in zip(box_offsets, local_shape, strict=True)
        )
        for (offsets, sizes), is_whole in ((whole, True), ((box_offsets, box_sizes), False)):
            for full_offsets, local_offsets, local_sizes in place_local_box(
                spec, local_shape, rank, world, offsets, sizes
            ):
                # The part lies inside the asked box.
                for o, s, lo, ls in zip(offsets, sizes, local_offsets, local_sizes, strict=True):
                    assert o <= lo
                    assert lo + ls <= o + s
                mine = local[
                    tuple(slice(o, o + s) for o, s in zip(local_offsets, local_sizes, strict=True))
                ]
                if spec.transpose:
                    mine = mine.t()
                where = tuple(
                    slice(o, o + s) for o, s in zip(full_offsets, mine.shape, strict=True)
                )
                torch.testing.assert_close(mine, full[where], rtol=0, atol=0)
                if is_whole:
                    covered[where] += 1
    # The ranks' whole shards cover each element of the full tensor once.
    assert torch.equal(covered, torch.ones(shape)), covered
