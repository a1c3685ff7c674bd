"""What pc's two sequence-parallel attentions share (Ulysses in
:mod:`pc_tensor.ulysses`, ring attention in :mod:`pc_tensor.ring`): the
record of which modules run sequence parallelism over which group, how a
model is prepared for either attention, what either refuses, and the
forward and loss that split the whole batch's sequence over the group.

The record is pc-tensor's own (:func:`sequence_group` reads it): weak
references to the user's modules, nothing written on them, so a module's
entry goes when the module does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.hooks import ForwardHooks

__all__ = [
    "sequence_group",
    "sequence_lm_loss",
    "sequence_positions",
    "sync_sequence_grads",
]

# Every module of a prepared model -> the group its attention runs over.
_GROUPS: weakref.WeakKeyDictionary[nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()
# The models prepared (the root :func:`attend` was called on) -> their group.
_PREPARED: weakref.WeakKeyDictionary[nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def sequence_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The sequence-parallel group ``module``'s attention runs over: set for
    every module of a model that :func:`~pc_tensor.ulysses_model`,
    :func:`~pc_tensor.ring_model` or :func:`~pc_tensor.sequence_attention`
    prepared; None for any other module."""
    return _GROUPS.get(module)


def prepared_group(model: nn.Module) -> dist.ProcessGroup:
    """The group ``model`` itself was prepared over (KeyError if it was not)."""
    return _PREPARED[model]


def group_for_attention(module: nn.Module, attention: str, maker: str) -> dist.ProcessGroup:
    """The group an attention call on ``module`` runs over; RuntimeError
    naming ``maker`` where no model containing it was prepared."""
    group = sequence_group(module)
    if group is None:
        raise RuntimeError(
            f"{type(module).__name__} runs pc's {attention} but was not prepared by "
            f"pc_tensor.{maker}."
        )
    return group


def refuse_unsupported(
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


def prepare(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    grad_scale: float,
    attention: tuple[str, Any],
    zigzag: bool,
    label: str,
) -> nn.Module:
    """``model`` set to run the registered ``attention`` (name, function)
    over ``group``, its forward wrapped to take the whole batch."""
    group = attend(model, group, attention)
    causal = is_causal_lm(model)
    split = _SequenceSplit(group, causal, grad_scale, zigzag, label)
    ForwardHooks(model, split.before, split.after)  # [Note: forward hooks, not forward assignment]
    return model


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a causal language model whose loss is over the
    next tokens: a class transformers lists as one (``GPT2LMHeadModel`` as
    well as the ``...ForCausalLM`` ones), or one named like them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    listed = {n for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in _names(names)}
    return name in listed or name.endswith("ForCausalLM")


def _names(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def attend(
    model: nn.Module, group: dist.ProcessGroup | None, attention: tuple[str, Any]
) -> dist.ProcessGroup:
    """``model``'s attention set to the registered ``attention`` over
    ``group``; returns the group."""
    name, function = attention
    _register(name, function)
    group = group if group is not None else dist.group.WORLD
    assert group is not None
    if model in _PREPARED:
        raise ValueError("this model already runs sequence parallelism (Ulysses or ring).")
    for module in model.modules():
        _GROUPS[module] = group
    setter: Any = getattr(model, "set_attn_implementation", None)
    if not callable(setter):
        raise ValueError(
            f"sequence parallelism switches {type(model).__name__}'s attention through "
            "transformers' public set_attn_implementation, which it lacks: pass a "
            "transformers PreTrainedModel (transformers >= 4.56 has it)."
        )
    setter(name)
    _PREPARED[model] = group
    return group


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
    rank_term: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next-token loss of the whole sequence from this rank's share of
    the logits (``[batch, share, vocab]``, the positions of
    :func:`sequence_positions`) and the whole sequence's ``labels``
    (``[batch, total]``, -100 ignored): the labels are shifted before the
    split, the sum is divided by the whole sequence's targets, and the
    result is summed over ``group`` (every rank gets the whole loss;
    backward gives each rank its own part, times ``grad_scale``).
    ``rank_term``, a term of this rank's tokens alone (a mixture-of-experts
    model's weighted auxiliary loss), is averaged over the group and added
    [Note: auxiliary loss under sequence parallelism]."""
    total = labels.shape[1]
    mine = sequence_positions(total, group, zigzag=zigzag, device=labels.device)
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    count = (shifted != -100).sum().clamp(min=1)
    targets = shifted.index_select(1, mine).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    part = nn.functional.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / count
    if rank_term is not None:
        part = part + rank_term.to(part.device) / dist.get_world_size(group)
    loss: torch.Tensor = _SumOverGroup.apply(part, group, grad_scale)  # type: ignore[no-untyped-call, unused-ignore]
    return loss


class _SequenceSplit:
    """The model called on the whole batch, as :class:`ForwardHooks`: its
    own forward gets this rank's share of the sequence (one contiguous
    block; under ``zigzag``, blocks ``r`` and ``2 * world - 1 - r`` of
    ``2 * world``, which balances causal attention's work) with its
    positions; with ``labels``, the output's loss is the next-token loss of
    the whole sequence (labels shifted before the split), summed over the
    group, divided by the whole sequence's tokens."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        causal: bool,
        grad_scale: float,
        zigzag: bool = False,
        name: str = "Ulysses sequence parallelism",
    ) -> None:
        self.group, self.causal = group, causal
        self.grad_scale, self.zigzag, self.name = grad_scale, zigzag, name

    def share(self, total: int, device: torch.device) -> torch.Tensor:
        """The positions of the sequence this rank holds."""
        return sequence_positions(
            total, self.group, zigzag=self.zigzag, device=device, name=self.name
        )

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
        kwargs = dict(kwargs)
        if args:  # input_ids, the first positional argument of every causal LM
            if len(args) > 1:
                raise TypeError(
                    f"a model under {self.name} takes input_ids positionally and the rest "
                    f"by keyword; got {len(args)} positional arguments."
                )
            if "input_ids" in kwargs:
                raise TypeError("input_ids given both positionally and by keyword.")
            kwargs["input_ids"] = args[0]
        input_ids = kwargs.pop("input_ids", None)
        labels = kwargs.pop("labels", None)
        position_ids = kwargs.pop("position_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
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
        kwargs["input_ids"] = input_ids.index_select(1, mine)
        kwargs["position_ids"] = position_ids.index_select(1, mine)
        if labels is None:
            return (), kwargs, False
        if not self.causal:
            raise ValueError(
                f"{self.name} computes the loss of causal language models; for another head, "
                "call the model without labels and compute the loss from each rank's share "
                "of the outputs."
            )
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        count = (shifted != -100).sum()
        targets = shifted.index_select(1, mine.to(shifted.device)).contiguous()
        kwargs.update(labels=targets, shift_labels=targets, num_items_in_batch=count)
        return (), kwargs, True

    def after(self, module: nn.Module, out: Any, labelled: bool) -> Any:
        if not labelled:
            return out
        part = out["loss"]
        aux = out.get("aux_loss") if isinstance(out, dict) else None
        if aux is not None:  # [Note: auxiliary loss under sequence parallelism]
            from pc_tensor.hooks import aux_loss_coefficient

            size = dist.get_world_size(self.group)
            part = part - aux_loss_coefficient(module) * aux.to(part.device) * (1 - 1 / size)
        out["loss"] = _SumOverGroup.apply(part, self.group, self.grad_scale)  # type: ignore[no-untyped-call, unused-ignore]
        return out


# [Note: auxiliary loss under sequence parallelism]
# A mixture-of-experts model adds to its loss its auxiliary (load-
# balancing) loss, a function of the router's choices for the tokens it
# saw: under sequence parallelism, this rank's share of the sequence. The
# language-model parts are summed over the group (each is already divided
# by the whole sequence's targets); the auxiliary losses are averaged over
# it, as data parallelism averages each rank's, so the loss counts the
# auxiliary term once, not once per rank.


def sync_sequence_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the sequence-parallel group: each
    rank's is the part of its block of the sequence."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
