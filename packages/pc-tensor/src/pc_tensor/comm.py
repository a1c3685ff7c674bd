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

__all__ = ["copy_to_tp", "gather_from_tp", "reduce_from_tp", "split_to_tp"]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over {world} ranks evenly."
        )
    return x.chunk(world, dim=dim)[rank].contiguous()


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
