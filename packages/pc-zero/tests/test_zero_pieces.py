"""[Note: pieces]: a flat range as boxes, and pieces saved by DCP in one
layout and read back in another, in one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from pc_zero import Pieces, PiecesLoadPlanner, PiecesSavePlanner, flat_range_boxes


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_boxes_cover_exactly_the_range_in_order(
    shape: list[int], bounds: tuple[float, float]
) -> None:
    total = math.prod(shape)
    start, stop = sorted(int(b * total) for b in bounds)
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    whole = torch.arange(total).view(shape)
    covered = [
        whole[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))].reshape(-1)
        for b in boxes
    ]
    got = torch.cat(covered) if covered else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, stop))
    for box in boxes:  # each is contiguous in the flattened tensor
        assert int(whole[tuple(box.offsets)]) == box.flat_start


def test_pieces_saved_as_flat_ranges_load_as_boxes_and_whole(tmp_path: Path) -> None:
    weight = torch.randn(5, 6)
    flat = weight.reshape(-1).clone()
    saved = Pieces(weight.shape, torch.float32)
    for lo, hi in ((0, 7), (7, 19), (19, 30)):  # three "ranks'" shards, rows cut anywhere
        saved.add_flat(lo, flat[lo:hi])
    save({"w": saved}, checkpoint_id=str(tmp_path), planner=PiecesSavePlanner(), no_dist=True)

    left, right = torch.zeros(5, 4), torch.zeros(5, 2)  # a column split, as tensor parallelism
    boxes = Pieces(weight.shape, torch.float32)
    boxes.add_box((0, 0), left)
    boxes.add_box((0, 4), right)
    load({"w": boxes}, checkpoint_id=str(tmp_path), planner=PiecesLoadPlanner(), no_dist=True)
    assert torch.equal(torch.cat([left, right], 1), weight)

    whole = {"w": torch.zeros(5, 6)}
    load(whole, checkpoint_id=str(tmp_path), planner=PiecesLoadPlanner(), no_dist=True)
    assert torch.equal(whole["w"], weight)


def test_a_piece_in_another_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"saved as torch\.float32"):
        Pieces((4,), torch.float32).add_flat(0, torch.zeros(4, dtype=torch.bfloat16))


def test_objects_beside_pieces_come_back_in_the_callers_dict(tmp_path: Path) -> None:
    """Hyperparameters and a loss scale are saved as objects: the load hands
    them back in the dict the caller passed (DCP's default keeps them in a
    copy of its own, flatten_state_dict=False as the booster saves)."""
    groups = [{"lr": 1e-3, "params": ["w"]}]
    weight = Pieces((4,), torch.float32)
    weight.add_flat(0, torch.arange(4.0))
    state: dict[str, object] = {"w": weight, "groups": groups}
    planner = PiecesSavePlanner(flatten_state_dict=False)
    save(state, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
    target = torch.zeros(4)
    state = {"w": target, "groups": [{"lr": 5e-3, "params": ["w"]}]}
    load(
        state,
        checkpoint_id=str(tmp_path),
        planner=PiecesLoadPlanner(flatten_state_dict=False),
        no_dist=True,
    )
    assert state["groups"] == groups
    assert torch.equal(target, torch.arange(4.0))
