"""The ``Communicator`` protocol every layer of pc talks through.

Algorithms (DDP buckets, ZeRO shards, pipeline schedules) take a
``Communicator`` rather than a ``ProcessGroup``, so the same algorithm runs
over torch.distributed, over host shared memory, or over a hierarchical
composition of both. Every operation returns a :class:`Handle`; with
``async_op=False`` the handle is already complete. Results are valid only
after ``wait()`` returns, exactly as with torch's ``Work`` objects.

Ranks passed to a communicator (``src``, ``dst``, ``peer``) are ranks *within
the communicator*, 0 to ``world_size - 1``, never global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple, Protocol, runtime_checkable

import torch

__all__ = [
    "Communicator",
    "CompletedHandle",
    "Handle",
    "P2PKind",
    "P2POp",
    "ReduceOp",
    "SymmetricAllocator",
    "check_all_gather",
    "check_all_gather_list",
    "check_contiguous",
    "check_reduce_op",
    "check_reduce_scatter",
    "check_reduce_scatter_list",
    "divide_for_average",
]


class ReduceOp(Enum):
    """Reductions. ``AVG`` is the sum divided by the world size; on integer
    tensors the division rounds toward zero."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


def divide_for_average(total: torch.Tensor, world_size: int) -> None:
    """Turn a sum over ``world_size`` ranks into ``ReduceOp.AVG``, in place:
    true division on floating tensors, rounding toward zero on integers."""
    if total.dtype.is_floating_point or total.dtype.is_complex:
        total.div_(world_size)
    else:
        total.copy_(torch.div(total, world_size, rounding_mode="trunc"))


@runtime_checkable
class Handle(Protocol):
    """An operation in flight. ``wait()`` blocks until its result is in the
    output tensors (on CUDA: until the current stream is ordered after it).
    With ``timeout`` (seconds) it raises :class:`TimeoutError` if the
    operation has not finished by then: a peer that failed or hangs."""

    def wait(self, timeout: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class CompletedHandle:
    """The handle of an operation that has already finished."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class P2PKind(Enum):
    SEND = "send"
    RECV = "recv"


class P2POp(NamedTuple):
    """One send or receive in a batch (see ``Communicator.batch_p2p``)."""

    kind: P2PKind
    tensor: torch.Tensor
    peer: int


@runtime_checkable
class Communicator(Protocol):
    """Collectives and point-to-point operations over a fixed set of ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle:
        """Reduce ``tensor`` across ranks, in place. Any size and shape."""
        ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        """Flat reduce-scatter: ``input`` holds ``world_size`` equal contiguous
        slices; rank ``r`` receives the reduction of slice ``r``."""
        ...

    def reduce_scatter_list(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        """Reduce-scatter of one tensor per rank; sizes may differ between
        ranks' slots (``output`` matches ``inputs[rank]``)."""
        ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Flat all-gather: ``output`` is ``world_size`` slices of
        ``input.numel()`` elements, slice ``r`` from rank ``r``."""
        ...

    def all_gather_list(
        self, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """All-gather into one tensor per rank; ranks may contribute
        different sizes (``outputs[r]`` has rank ``r``'s size)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        ...

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Handle: ...

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle: ...

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Start several sends and receives together (asynchronously); wait
        on every returned handle. Order within a batch cannot deadlock."""
        ...

    def barrier(self) -> None: ...


@runtime_checkable
class AllToAll(Protocol):
    """A communicator with an all-to-all of uneven pieces (pc-comm's
    shared-memory one; torch.distributed's ``all_to_all_single`` elsewhere)."""

    def all_to_all(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Handle:
        """``inputs[r]`` goes to rank ``r``; ``outputs[r]`` receives what
        rank ``r`` sent this rank. Sizes may differ between pieces; one dtype."""
        ...


@runtime_checkable
class SymmetricAllocator(Protocol):
    """A communicator that can place tensors in memory its peers can reach
    directly; all-reducing such a tensor skips staging copies."""

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a zero-filled 1-D host tensor of ``numel`` elements."""
        ...


# Shape checks shared by every implementation, so each one rejects bad input
# with the same message.


def _same_kind(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"{what}: output and input must share dtype and device, got "
            f"{a.dtype}/{a.device} and {b.dtype}/{b.device}."
        )


def check_reduce_scatter(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    _same_kind(output, input, "reduce_scatter")
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected world_size "
            f"({world_size}) * output ({output.numel()}) = {world_size * output.numel()}. "
            "Pad the input to a multiple of the world size, or use reduce_scatter_list "
            "for uneven slices."
        )


def check_all_gather(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    _same_kind(output, input, "all_gather")
    if output.numel() != world_size * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected world_size "
            f"({world_size}) * input ({input.numel()}) = {world_size * input.numel()}. "
            "Use all_gather_list when ranks contribute different sizes."
        )


def _check_list(kind: str, tensors: Sequence[torch.Tensor], world_size: int) -> None:
    if len(tensors) != world_size:
        raise ValueError(
            f"{kind}: expected one tensor per rank ({world_size}), got {len(tensors)}."
        )


def check_reduce_scatter_list(
    output: torch.Tensor, inputs: Sequence[torch.Tensor], rank: int, world_size: int
) -> None:
    _check_list("reduce_scatter_list", inputs, world_size)
    for i, tensor in enumerate(inputs):
        _same_kind(output, tensor, f"reduce_scatter_list (inputs[{i}])")
    if output.numel() != inputs[rank].numel():
        raise ValueError(
            f"reduce_scatter_list: output has {output.numel()} elements but this rank's "
            f"slot inputs[{rank}] has {inputs[rank].numel()}; they must match."
        )


def check_all_gather_list(
    outputs: Sequence[torch.Tensor], input: torch.Tensor, rank: int, world_size: int
) -> None:
    _check_list("all_gather_list", outputs, world_size)
    for i, tensor in enumerate(outputs):
        _same_kind(tensor, input, f"all_gather_list (outputs[{i}])")
    if outputs[rank].numel() != input.numel():
        raise ValueError(
            f"all_gather_list: input has {input.numel()} elements but this rank's slot "
            f"outputs[{rank}] has {outputs[rank].numel()}; they must match."
        )


def check_contiguous(tensor: torch.Tensor, what: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be contiguous (collectives work on flat memory); "
            "pass tensor.contiguous() and copy the result back."
        )


def check_reduce_op(op: object) -> None:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a pc_comm.ReduceOp, got {op!r}.")
