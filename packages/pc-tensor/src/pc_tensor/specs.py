"""How :func:`~pc_tensor.shard_model` split one parameter
(:class:`ShardSpec`), and what follows from it for one tensor: the full
tensor gathered from the shards (:func:`unshard_tensor`), a rank's shard cut
from the full tensor (:func:`shard_tensor`), and, by index arithmetic alone,
the full shape (:func:`full_shape`) and where a box of a shard lies in the
full tensor (:func:`place_local_box`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ShardSpec", "full_shape", "place_local_box", "shard_tensor", "unshard_tensor"]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter was split: along ``dim`` of its sharded layout, as
    ``parts`` fused blocks each split separately, the full tensor cut back to
    ``size`` along ``dim`` (vocabulary padding) and transposed back to the
    original layout where the original was a ``Conv1D``."""

    dim: int
    parts: int = 1
    size: int | None = None
    transpose: bool = False


def unshard_tensor(tensor: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor, in the original layout, from every rank's ``tensor``
    split as ``spec`` says (a collective over ``group``)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=group)
    if spec.parts > 1:
        blocks = [p.chunk(spec.parts, dim=spec.dim) for p in pieces]
        full = torch.cat(
            [torch.cat([b[k] for b in blocks], dim=spec.dim) for k in range(spec.parts)],
            dim=spec.dim,
        )
    else:
        full = torch.cat(pieces, dim=spec.dim)
    if spec.size is not None:
        full = full.narrow(spec.dim, 0, spec.size)
    return full.t().contiguous() if spec.transpose else full


def full_shape(spec: ShardSpec, local_shape: torch.Size, world: int) -> torch.Size:
    """The full tensor's shape (original layout, padding dropped) of which
    ``local_shape`` is one of ``world`` shards split as ``spec`` says."""
    shape = list(local_shape)
    shape[spec.dim] = spec.size if spec.size is not None else shape[spec.dim] * world
    return torch.Size(reversed(shape) if spec.transpose else shape)


def place_local_box(
    spec: ShardSpec,
    local_shape: torch.Size,
    rank: int,
    world: int,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Where the box ``offsets`` / ``sizes`` of rank ``rank``'s shard (in
    the shard's own layout) lies in the full tensor, as
    :func:`unshard_tensor` assembles it: one ``(full offsets, local
    offsets, local sizes)`` per contiguous part (a fused projection's
    ``parts`` blocks land apart), padding rows dropped. The full box's
    sizes are the local sizes, reversed where ``spec.transpose``; its
    values are the local box's, transposed there. Index arithmetic only:
    a sharded checkpoint writes each rank's pieces where they belong with
    it, and reads them back from any other layout."""
    dim = spec.dim
    block = local_shape[dim] // spec.parts  # this rank's rows of one part
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out = []
    for part in range(spec.parts):
        start, stop = max(lo, part * block), min(hi, (part + 1) * block)
        if start >= stop:
            continue
        where = part * block * world + rank * block + (start - part * block)
        count = stop - start
        if spec.size is not None:  # vocabulary padding past the real rows
            count = min(count, spec.size - where)
            if count <= 0:
                continue
        local_offsets, local_sizes, full_offsets = list(offsets), list(sizes), list(offsets)
        local_offsets[dim], local_sizes[dim], full_offsets[dim] = start, count, where
        if spec.transpose:
            full_offsets.reverse()
        out.append((tuple(full_offsets), tuple(local_offsets), tuple(local_sizes)))
    return out


def shard_tensor(
    full: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup, local_shape: torch.Size
) -> torch.Tensor:
    """This rank's piece of ``full`` (original layout) split as ``spec``
    says, shaped ``local_shape``: the inverse of :func:`unshard_tensor`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tensor = full.t() if spec.transpose else full
    if spec.size is not None:  # padding rows up to the padded vocabulary
        padded = local_shape[spec.dim] * world
        extra = padded - tensor.shape[spec.dim]
        if extra:
            shape = list(tensor.shape)
            shape[spec.dim] = extra
            tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=spec.dim)
    if spec.parts > 1:
        pieces = [p.chunk(world, dim=spec.dim)[rank] for p in tensor.chunk(spec.parts, spec.dim)]
        mine = torch.cat(pieces, dim=spec.dim)
    else:
        mine = tensor.chunk(world, dim=spec.dim)[rank]
    if mine.shape != local_shape:
        raise ValueError(
            f"a full tensor of shape {tuple(full.shape)} does not shard to this rank's "
            f"{tuple(local_shape)}: was it saved from another model?"
        )
    return mine.contiguous()
