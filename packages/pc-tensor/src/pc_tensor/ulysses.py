"""Ulysses sequence parallelism (DeepSpeed-Ulysses,
``sequence_parallelism_mode="all_to_all"``) for ``transformers`` models: each rank of a sequence-
parallel group holds a contiguous block of the sequence through the whole
model; around attention, an all-to-all swaps the sequence blocks for
blocks of heads, so each rank attends over the whole sequence with its
share of the heads, and a second all-to-all swaps back.

``ulysses_model(model, group)`` does it in place for any model whose
attention goes through transformers' attention interface (every family in
transformers 5): it registers an attention implementation that wraps
torch's ``scaled_dot_product_attention`` in the two all-to-alls, and wraps
the model's forward so that it takes the whole batch, keeps this rank's
block of the sequence with its positions, and computes the loss of the
whole sequence (next-token labels shifted before the split, divided by the
tokens of the whole sequence, summed over the group). Gradients of the
replicated parameters are partial sums per rank: :func:`~pc_tensor.sync_sequence_grads`
sums them over the group (under data parallelism, average over data-
parallel ranks as usual after that).

Activation memory per rank falls as 1/sp: every activation outside
attention holds 1/sp of the tokens, and attention holds 1/sp of the heads.

Grouped-query attention: key/value heads split with the query heads when
their count divides by sp; when sp divides their count instead, each is
repeated so every rank gets the one its query heads read.

Refused with the numbers: a sequence the group cannot split evenly, head
counts that do not fit, attention dropout, sliding windows shorter than
the sequence, logit soft-capping, padding masks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.sequence import group_for_attention, prepare, refuse_unsupported

__all__ = [
    "ATTENTION",
    "heads_to_sequence",
    "sequence_to_heads",
    "ulysses_attention",
    "ulysses_model",
]

ATTENTION = "pc_ulysses"


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all along dim 0 of ``x`` ([world, ...])."""
    x = x.contiguous()  # the exchange reads and writes memory in order:
    out = torch.empty_like(x)  # a permuted view's strides would scramble it
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, world, h // world, s, d).permute(1, 0, 2, 3, 4)
    got = _exchange(parts, group)  # [world (sequence block), b, h/world, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4)
    got = _exchange(parts, group)  # [world (head block), b, h, s/world, d]
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * h, s // world, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[batch, heads, sequence/world, dim]`` (this rank's block of the
    sequence, every head) to ``[batch, heads/world, sequence, dim]`` (the
    whole sequence, this rank's block of heads). Backward is the inverse."""
    out: torch.Tensor = _SeqToHeads.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`."""
    out: torch.Tensor = _HeadsToSeq.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def _kv_for_heads(x: torch.Tensor, heads: int, world: int, what: str) -> torch.Tensor:
    """Key/value heads made splittable over ``world`` next to ``heads``
    query heads: as they are when ``world`` divides them; each repeated
    when their count divides ``world``."""
    kv = x.shape[1]
    if kv % world == 0:
        return x
    if world % kv == 0 and heads % world == 0:
        return x.repeat_interleave(world // kv, dim=1)
    raise ValueError(
        f"Ulysses sequence parallelism over {world} ranks splits attention heads: {what} has "
        f"{kv} key/value heads beside {heads} query heads, and neither divides the other by "
        f"{world}. Use a sequence-parallel size that divides both, or one that {kv} divides."
    )


def ulysses_attention(
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
    group = group_for_attention(module, "Ulysses attention", "ulysses_model")
    world = dist.get_world_size(group)
    what = type(module).__name__
    refuse_unsupported(
        "Ulysses sequence parallelism", what, query.shape[2] * world, dropout, sliding_window,
        softcap,
    )  # fmt: skip
    heads = query.shape[1]
    if heads % world:
        raise ValueError(
            f"Ulysses sequence parallelism over {world} ranks splits attention heads: {what} "
            f"has {heads} query heads (after tensor parallelism), which {world} does not "
            "divide. Use a sequence-parallel size that divides the heads."
        )
    key = _kv_for_heads(key, heads, world, what)
    value = _kv_for_heads(value, heads, world, what)
    q = sequence_to_heads(query, group)
    k = sequence_to_heads(key, group)
    v = sequence_to_heads(value, group)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each query head's own
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else is_causal
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling)
    return heads_to_sequence(out, group).transpose(1, 2).contiguous(), None


def ulysses_model(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, grad_scale: float = 1.0
) -> nn.Module:
    """Ulysses sequence parallelism over ``group`` (default: the world) for
    ``model`` in place (see the module docstring); after tensor
    parallelism, if any. Returns the model. ``grad_scale``: each rank's
    gradients are multiplied by it, for a reduction that averages over the
    sequence-parallel ranks (DDP or ZeRO over data x sequence parallel
    ranks: pass the sequence-parallel size) instead of summing them
    (:func:`~pc_tensor.sync_sequence_grads`)."""
    return prepare(
        model,
        group,
        grad_scale,
        (ATTENTION, ulysses_attention),
        False,
        "Ulysses sequence parallelism",
    )
