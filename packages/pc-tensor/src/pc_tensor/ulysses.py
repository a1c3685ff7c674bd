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
replicated parameters are partial sums per rank: :func:`sync_sequence_grads`
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

__all__ = [
    "ATTENTION",
    "heads_to_sequence",
    "sequence_attention",
    "sequence_lm_loss",
    "sequence_positions",
    "sequence_to_heads",
    "sync_sequence_grads",
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


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (the whole sequence's loss on every
    rank). Backward: each rank's own part, unchanged; the replicated
    parameters' gradients are summed afterwards (sync_sequence_grads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None, None


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
    group = _group_of(module, "Ulysses attention", "ulysses_model")
    world = dist.get_world_size(group)
    what = type(module).__name__
    _refuse_unsupported(
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


# What both of pc's sequence-parallel attentions (Ulysses here, ring
# attention in pc_tensor.ring) share: how a model is prepared for one, how
# an attention call finds its group, and what either refuses.


def _group_of(module: nn.Module, attention: str, maker: str) -> dist.ProcessGroup:
    group: dist.ProcessGroup | None = getattr(module, "_pc_sequence_group", None)
    if group is None:
        raise RuntimeError(
            f"{type(module).__name__} runs pc's {attention} but was not prepared by "
            f"pc_tensor.{maker}."
        )
    return group


def _refuse_unsupported(
    label: str,
    what: str,
    total: int,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """What neither attention implements yet, refused with the numbers."""
    if dropout:
        raise ValueError(
            f"{label}: {what} has attention dropout {dropout}; pc's attention for it runs "
            "without it. Set the config's attention dropout to 0."
        )
    if sliding_window is not None and sliding_window < total:
        raise ValueError(
            f"{label}: {what} attends over a sliding window of {sliding_window} tokens, "
            f"shorter than the sequence ({total}); sliding windows are not implemented yet."
        )
    if softcap:
        raise ValueError(
            f"{label}: {what} soft-caps its attention logits, which is not implemented yet."
        )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask pc's sequence-parallel attention is given: none (causality
    is the attention's own; padding masks are refused at the forward)."""
    return


_registered: set[str] = set()


def _register(name: str, attention: Any) -> None:
    if name in _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    _registered.add(name)


def _prepare(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    grad_scale: float,
    attention: tuple[str, Any],
    zigzag: bool,
    label: str,
) -> nn.Module:
    """``model`` set to run the registered ``attention`` (name, function)
    over ``group``, its forward wrapped to take the whole batch."""
    group = _attend(model, group, attention)
    causal = type(model).__name__.endswith("ForCausalLM")
    model.forward = _SequenceForward(model.forward, group, causal, grad_scale, zigzag, label)
    return model


def _attend(
    model: nn.Module, group: dist.ProcessGroup | None, attention: tuple[str, Any]
) -> dist.ProcessGroup:
    """``model``'s attention set to the registered ``attention`` over
    ``group``; returns the group."""
    name, function = attention
    _register(name, function)
    group = group if group is not None else dist.group.WORLD
    assert group is not None
    if getattr(model, "_pc_ulysses", None) is not None:
        raise ValueError("this model already runs sequence parallelism (Ulysses or ring).")
    for module in model.modules():
        module.__dict__["_pc_sequence_group"] = group
    setter: Any = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        config: Any = model.config
        config._attn_implementation = name
    model.__dict__["_pc_ulysses"] = group
    return group


def sequence_attention(model: nn.Module, group: dist.ProcessGroup, mode: str) -> nn.Module:
    """Only the attention of :func:`ulysses_model` (``mode="all_to_all"``)
    or :func:`~pc_tensor.ring_model` (``"ring_attn"``) over ``group``,
    leaving the model's forward as it is: for callers that split the
    sequence themselves (pipeline stages, with :func:`sequence_positions`
    and :func:`sequence_lm_loss`). Returns the model."""
    if mode == "all_to_all":
        _attend(model, group, (ATTENTION, _attention))
    elif mode == "ring_attn":
        from pc_tensor.ring import RING_ATTENTION, prepare_links
        from pc_tensor.ring import _attention as ring_attention

        _attend(model, group, (RING_ATTENTION, ring_attention))
        prepare_links(model)
    else:
        raise ValueError(f"mode must be 'all_to_all' or 'ring_attn', got {mode!r}.")
    return model


def sequence_positions(
    total: int,
    group: dist.ProcessGroup,
    *,
    zigzag: bool,
    device: torch.device | None = None,
    name: str = "sequence parallelism",
) -> torch.Tensor:
    """The positions of a ``total``-token sequence this rank of ``group``
    holds: one contiguous block, or under ``zigzag`` (ring attention on a
    causal model) blocks ``r`` and ``2 * world - 1 - r`` of ``2 * world``.
    Raises ValueError when the sequence does not split so."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = 2 * world if zigzag else world
    if total % parts:
        raise ValueError(
            f"{name} over {world} ranks splits the sequence into {parts} equal "
            f"blocks: {total} tokens do not divide by {parts}. Pad or cut the sequence to "
            f"a multiple of {parts} (e.g. {total - total % parts} or "
            f"{total + parts - total % parts})."
        )
    size = total // parts
    blocks = [rank, parts - 1 - rank] if zigzag else [rank]
    return torch.cat([torch.arange(b * size, (b + 1) * size, device=device) for b in blocks])


def sequence_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    zigzag: bool,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """The next-token loss of the whole sequence from this rank's share of
    the logits (``[batch, share, vocab]``, the positions of
    :func:`sequence_positions`) and the whole sequence's ``labels``
    (``[batch, total]``, -100 ignored): the labels are shifted before the
    split, the sum is divided by the whole sequence's targets, and the
    result is summed over ``group`` (every rank gets the whole loss;
    backward gives each rank its own part, times ``grad_scale``)."""
    total = labels.shape[1]
    mine = sequence_positions(total, group, zigzag=zigzag, device=labels.device)
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    count = (shifted != -100).sum().clamp(min=1)
    targets = shifted.index_select(1, mine).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    part = nn.functional.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / count
    loss: torch.Tensor = _SumOverGroup.apply(part, group, grad_scale)  # type: ignore[no-untyped-call, unused-ignore]
    return loss


class _SequenceForward:
    """The model's forward on the whole batch: this rank's share of the
    sequence (one contiguous block; under ``zigzag``, blocks ``r`` and
    ``2 * world - 1 - r`` of ``2 * world``, which balances causal
    attention's work) with its positions; with ``labels``, the next-token
    loss of the whole sequence (labels shifted before the split), summed
    over the group, divided by the whole sequence's tokens."""

    def __init__(
        self,
        forward: Any,
        group: dist.ProcessGroup,
        causal: bool,
        grad_scale: float,
        zigzag: bool = False,
        name: str = "Ulysses sequence parallelism",
    ) -> None:
        self.forward, self.group, self.causal = forward, group, causal
        self.grad_scale, self.zigzag, self.name = grad_scale, zigzag, name

    def share(self, total: int, device: torch.device) -> torch.Tensor:
        """The positions of the sequence this rank holds."""
        return sequence_positions(
            total, self.group, zigzag=self.zigzag, device=device, name=self.name
        )

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if input_ids is None:
            raise ValueError(f"a model under {self.name} takes input_ids (the whole batch).")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                f"{self.name}: the batch has padding (an attention_mask with zeros), which "
                "pc's sequence-parallel attention does not mask yet; pack the sequences or "
                "pass batches without padding."
            )
        batch, total = input_ids.shape
        mine = self.share(total, input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(total, device=input_ids.device).expand(batch, -1)
        local = {
            "input_ids": input_ids.index_select(1, mine),
            "position_ids": position_ids.index_select(1, mine),
        }
        if labels is None:
            return self.forward(**local, **kwargs)
        if not self.causal:
            raise ValueError(
                f"{self.name} computes the loss of causal language models; for another head, "
                "call the model without labels and compute the loss from each rank's share "
                "of the outputs."
            )
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        count = (shifted != -100).sum()
        targets = shifted.index_select(1, mine.to(shifted.device)).contiguous()
        out = self.forward(
            **local, labels=targets, shift_labels=targets, num_items_in_batch=count, **kwargs
        )
        out["loss"] = _SumOverGroup.apply(out["loss"], self.group, self.grad_scale)  # type: ignore[no-untyped-call, unused-ignore]
        return out


def ulysses_model(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, grad_scale: float = 1.0
) -> nn.Module:
    """Ulysses sequence parallelism over ``group`` (default: the world) for
    ``model`` in place (see the module docstring); after tensor
    parallelism, if any. Returns the model. ``grad_scale``: each rank's
    gradients are multiplied by it, for a reduction that averages over the
    sequence-parallel ranks (DDP or ZeRO over data x sequence parallel
    ranks: pass the sequence-parallel size) instead of summing them
    (:func:`sync_sequence_grads`)."""
    return _prepare(
        model, group, grad_scale, (ATTENTION, _attention), False, "Ulysses sequence parallelism"
    )


def sync_sequence_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the sequence-parallel group: each
    rank's is the part of its block of the sequence."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
