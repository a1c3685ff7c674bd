"""Ring attention (Colossal-AI's ``ring_attn``, torch's ``context_parallel``)
for ``transformers`` models: each rank of a sequence-parallel group keeps
its queries and passes key/value blocks around the ring, one step per
rank, combining the partial softmax results exactly by their log-sum-exp.

Under causal attention the sequence is split zig-zag: in ``2 * sp`` blocks,
rank ``r`` holds blocks ``r`` and ``2 * sp - 1 - r``, an early and a late
one, so every rank has the same amount of attention to compute. A query
block attends to key blocks before it whole, to its own block causally,
and skips those after it.

``ring_model(model, group)`` does it in place, as
:func:`~pc_tensor.ulysses_model` does for Ulysses: an attention
implementation registered with transformers' attention interface, and a
forward that takes the whole batch and returns the whole sequence's loss;
:func:`~pc_tensor.sync_sequence_grads` sums the gradients over the group.

Memory: each ring step's partial attention is recomputed in backward
(activation checkpointing), so what a rank keeps is its own queries and
the key/value blocks that passed it, linear in the sequence; the score
matrix of one pair of blocks exists only while it is computed.
Communication: the next key/value block is sent and received while the
current one is computed.

Grouped-query attention: key/value heads travel as they are and are
repeated to the query heads inside each step. Refused as for Ulysses:
attention dropout, sliding windows shorter than the sequence, soft-capping,
padding masks, a sequence that does not split into ``2 * sp`` blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from pc_tensor.ulysses import _group_of, _prepare, _refuse_unsupported

__all__ = ["RING_ATTENTION", "ring_model"]

RING_ATTENTION = "pc_ring"


def _exchange(
    x: torch.Tensor, group: dist.ProcessGroup, forward: bool
) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``x`` one step around the ring (to the next rank when
    ``forward``, else to the previous) and receiving the neighbour's; returns
    the receive buffer and the requests to wait on."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to = (rank + 1) % world if forward else (rank - 1) % world
    source = (rank - 1) % world if forward else (rank + 1) % world
    x = x.contiguous()
    got = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, to), group),
        dist.P2POp(dist.irecv, got, dist.get_global_rank(group, source), group),
    ]
    return got, dist.batch_isend_irecv(ops)


class _RingStart(torch.autograd.Function):
    """Forward: start passing a block to the next rank; the result is the
    buffer the previous rank's block lands in, valid after
    :class:`_RingWait` (the compute between the two overlaps the transfer).
    Backward: the gradient goes the other way round the ring."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, box: list[Any]
    ) -> torch.Tensor:
        ctx.group = group
        got, requests = _exchange(x, group, forward=True)
        box.extend(requests)
        return got

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        got, requests = _exchange(grad, ctx.group, forward=False)
        for request in requests:
            request.wait()
        return got, None, None


class _RingWait(torch.autograd.Function):
    """Forward: wait for the transfer :class:`_RingStart` began. Backward:
    nothing to wait for."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[Any]) -> torch.Tensor:
        for request in box:
            request.wait()
        box.clear()
        out: torch.Tensor = x.view_as(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _start(x: torch.Tensor, group: dist.ProcessGroup, box: list[Any]) -> torch.Tensor:
    out: torch.Tensor = _RingStart.apply(x, group, box)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def _wait(x: torch.Tensor, box: list[Any]) -> torch.Tensor:
    out: torch.Tensor = _RingWait.apply(x, box)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block over one key/value block: the normalised
    output and the log-sum-exp of its scores (``diagonal``: the same
    block, causally masked)."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if diagonal:
        size = scores.shape[-1]
        blocked = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(blocked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), v.float())
    return out, lse


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, part: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys, combined exactly."""
    if acc is None:
        return part
    (out_a, lse_a), (out_b, lse_b) = acc, part
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse), lse


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    group = _group_of(module, "ring attention", "ring_model")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    total = query.shape[2] * world
    _refuse_unsupported(
        "ring attention", type(module).__name__, total, dropout, sliding_window, softcap
    )
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else is_causal
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # This rank's query blocks (zig-zag: r and 2 * world - 1 - r).
    q_blocks = list(query.chunk(2, dim=2))
    q_ids = [rank, 2 * world - 1 - rank]
    kv = torch.cat([key, value], dim=1)  # one tensor travels the ring
    heads = key.shape[1]
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    for step in range(world):
        source = (rank - step) % world
        # The next block is on its way while this one is computed.
        box: list[Any] = []
        coming = _start(kv, group, box) if step < world - 1 else None
        k_all, v_all = kv[:, :heads], kv[:, heads:]
        k_blocks, v_blocks = k_all.chunk(2, dim=2), v_all.chunk(2, dim=2)
        k_ids = [source, 2 * world - 1 - source]
        for i, (q_block, q_id) in enumerate(zip(q_blocks, q_ids, strict=True)):
            for k_block, v_block, k_id in zip(k_blocks, v_blocks, k_ids, strict=True):
                if causal and k_id > q_id:
                    continue
                part = checkpoint(
                    _partial, q_block, k_block, v_block, scale, causal and k_id == q_id,
                    use_reentrant=False,
                )  # fmt: skip
                acc[i] = _merge(acc[i], part)
        if coming is not None:
            kv = _wait(coming, box)
    outs = []
    for result in acc:
        assert result is not None  # every query block sees at least its own block
        outs.append(result[0])
    out = torch.cat(outs, dim=2).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def ring_model(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, grad_scale: float = 1.0
) -> nn.Module:
    """Ring attention over ``group`` (default: the world) for ``model`` in
    place (see the module docstring); after tensor parallelism, if any.
    Returns the model. ``grad_scale`` as for
    :func:`~pc_tensor.ulysses_model`."""
    return _prepare(model, group, grad_scale, (RING_ATTENTION, _attention), True, "ring attention")
