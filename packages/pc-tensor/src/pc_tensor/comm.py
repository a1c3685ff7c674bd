"""The four autograd-aware collectives tensor parallelism is built from.

Each is the transpose of another in backward: copying an activation to every
rank sums the gradients; summing partial outputs passes the gradient
through unchanged; gathering a split keeps one's own slice of the gradient,
and splitting gathers it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

# A temporary all-reduced on gloo (``_reduce_scatter``) can leave gloo's work
# loop needing the GIL at exit; importing pc_comm registers the exit handler
# that lets it finish ([Note: threads at interpreter exit]).
import pc_comm  # noqa: F401

__all__ = [
    "copy_to_tp",
    "gather_from_tp",
    "gather_sequence",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "split_to_tp",
    "sync_replicated_grads",
]


def _is_fake(x: torch.Tensor) -> bool:
    """Shape-only tensors (a pipeline's shape inference runs stages under
    FakeTensorMode): collectives keep their shapes and move no data."""
    return x.is_meta or isinstance(x, FakeTensor)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    if not _is_fake(x):
        dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if _is_fake(x):
        return torch.cat([x] * world, dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over {world} ranks evenly."
        )
    return x.chunk(world, dim=dim)[rank].contiguous()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``dim``: one
    reduce-scatter where the backend has it (NCCL), an all-reduce and a
    slice on gloo, which has none."""
    if _is_fake(x) or dist.get_backend(group) == "gloo":
        return _split(_all_reduce(x.clone(), group), group, dim)
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over {world} ranks evenly."
        )
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the group."""
    out: torch.Tensor = _Copy.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group forward; identity backward."""
    out: torch.Tensor = _Reduce.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward keeps this
    rank's slice of the gradient."""
    out: torch.Tensor = _Gather.apply(x, group, dim)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def split_to_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim``; backward gathers."""
    out: torch.Tensor = _Split.apply(x, group, dim)  # type: ignore[no-untyped-call, unused-ignore]
    return out


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism's entry to a column-parallel layer: all-gather
    the sequence slices forward; backward sums the full-sequence gradients
    of every rank and keeps this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism's exit from a row-parallel layer: sum the partial
    outputs and keep this rank's sequence slice; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather sequence slices (``dim``); backward reduce-scatters."""
    out: torch.Tensor = _GatherSequence.apply(x, group, dim)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def reduce_scatter_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1
) -> torch.Tensor:
    """Sum over the group and keep this rank's sequence slice; backward
    all-gathers."""
    out: torch.Tensor = _ReduceScatterSequence.apply(x, group, dim)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def sync_replicated_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the gradients of parameters every rank holds whole (LayerNorm,
    biases of row-parallel layers) over the group. Under sequence
    parallelism each rank saw only its slice of the tokens, so each holds a
    partial gradient; call this after backward, before the optimizer step."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
