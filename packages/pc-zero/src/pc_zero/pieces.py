"""A tensor held in arbitrary pieces across ranks, as
``torch.distributed.checkpoint`` (DCP) saves and loads it.

[Note: pieces]
A ZeRO or chunk shard owns a contiguous range of a parameter's *flattened*
elements, which no DTensor placement describes. DCP, though, stores a
tensor as boxes (an offset and a size per dimension) of its global shape,
and reads any box back from whichever boxes were written: so a flat range
is written as the few boxes that cover it (:func:`flat_range_boxes`: a
partial first row, whole rows, a partial last row, recursively; at most
2 x ndim - 1), each a contiguous view of the range. :class:`Pieces`
presents a rank's boxes of one tensor to DCP through its checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``): on save every rank writes only its boxes, and a
box two ranks hold (a replicated tensor) is written once; on load DCP
copies into each box view the overlapping parts of whatever was saved, at
any world size and by any other layout (a DTensor, a tensor-parallel shard,
a whole tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from pc_zero.safe_load import safe_load_bytes

__all__ = ["Box", "Pieces", "PiecesLoadPlanner", "PiecesSavePlanner", "flat_range_boxes"]


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``offsets`` and ``sizes`` per dimension, and
    where its first element sits in the tensor's flattened elements."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor
    of ``shape``, in order; each is contiguous in the flattened tensor."""
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is not within a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:  # a scalar
        return [Box((), (), 0)]
    if len(shape) == 1:
        return [Box((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def within_row(row: int, lo: int, hi: int) -> list[Box]:
        return [
            Box((row, *b.offsets), (1, *b.sizes), row * inner + b.flat_start)
            for b in flat_range_boxes(shape[1:], lo, hi)
        ]

    if first == last:
        return within_row(first, head, tail)
    out: list[Box] = []
    if head:
        out += within_row(first, head, inner)
        first += 1
    if last > first:
        zeros = (0,) * (len(shape) - 1)
        out.append(Box((first, *zeros), (last - first, *shape[1:]), first * inner))
    if tail:
        out += within_row(last, 0, tail)
    return out


class Pieces:
    """This rank's pieces of a tensor of ``shape`` (the whole tensor's), for
    DCP [Note: pieces]. ``add_flat(start, values)``: a contiguous range of
    the flattened tensor, backed by the 1-D tensor ``values`` (written on
    save, filled on load); ``add_box(offsets, values)``: a box backed by a
    tensor of the box's shape."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        # The whole tensor's shape and the dtype it is saved in.
        self.shape = torch.Size(shape)
        self.dtype = dtype
        # Each box this rank holds, with the tensor (a view) backing it.
        self.boxes: list[tuple[Box, torch.Tensor]] = []

    def _check(self, values: torch.Tensor) -> None:
        # Loading copies into the views themselves: a converted copy would
        # be filled and dropped.
        if values.dtype != self.dtype:
            raise ValueError(
                f"a piece backed by {values.dtype} in a tensor saved as {self.dtype}: pass "
                "the tensor that holds the values in the saved dtype (the fp32 masters)"
            )

    def add_flat(self, start: int, values: torch.Tensor) -> None:
        self._check(values)
        if values.dim() != 1:
            raise ValueError(f"add_flat takes a 1-D tensor, got shape {tuple(values.shape)}")
        for box in flat_range_boxes(self.shape, start, start + values.numel()):
            lo = box.flat_start - start
            self.boxes.append((box, values[lo : lo + box.numel].view(box.sizes)))

    def add_box(self, offsets: Sequence[int], values: torch.Tensor) -> None:
        self._check(values)
        sizes = tuple(values.shape)
        if len(offsets) != len(self.shape) or any(
            o < 0 or o + s > full for o, s, full in zip(offsets, sizes, self.shape, strict=True)
        ):
            raise ValueError(
                f"box at {tuple(offsets)} of size {sizes} is not within shape {tuple(self.shape)}"
            )
        flat = sum(o * math.prod(self.shape[i + 1 :]) for i, o in enumerate(offsets))
        self.boxes.append((Box(tuple(offsets), sizes, flat), values))

    # -- DCP's checkpointable protocol ---------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)
                    ),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for box, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            for box, _ in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        wanted = tuple(index.offset) if index.offset is not None else None
        for box, values in self.boxes:
            if box.offsets == wanted:
                return values
        raise ValueError(f"no piece of {index.fqn} at offset {wanted} on this rank")


def _lookup(state_dict: dict[str, object], index: MetadataIndex) -> object | None:
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else None


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the data of
    :class:`Pieces` (the default looks up tensors only)."""

    def lookup_object(self, index: MetadataIndex) -> object:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also fills :class:`Pieces` (at
    the state dict's top level) and hands loaded objects (non-tensor
    values) back in the caller's state dict."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # DCP's set-up replaces, in place, every value it does not know
        # (here: Pieces) by None; they are put back after it.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP's default unpickles an object with torch.load(weights_only=
        # False), which runs whatever code the file names: read it with the
        # weights-only unpickler instead [Note: loading runs no code]. And
        # DCP puts it into its own copy of the state dict, which the caller
        # never sees: put it into the caller's too.
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        loaded = safe_load_bytes(value, f"checkpoint item {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
            return
        self.state_dict[fqn] = loaded
        self.original_state_dict[fqn] = loaded

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        if isinstance(found, torch.Tensor):
            return found
        return super().lookup_tensor(index)
