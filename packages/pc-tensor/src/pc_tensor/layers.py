"""Tensor-parallel layers, built from an existing (unsharded) layer so the
sharded model starts from exactly the weights of the unsharded one.

- :class:`ColumnParallelLinear` splits the output features: each rank
  computes a slice of the output (optionally gathered).
- :class:`RowParallelLinear` splits the input features: each rank computes a
  partial sum of the output, summed over the group.
- :class:`VocabParallelEmbedding` splits the vocabulary rows.
- :func:`vocab_parallel_cross_entropy` computes the loss from vocabulary-
  sharded logits without ever gathering them.

GPT-2's ``Conv1D`` stores its weight transposed (``[in, out]``); the
``from_conv1d`` constructors read it as such.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.comm import (
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_to_tp,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]


def _shard_size(total: int, group: dist.ProcessGroup, what: str) -> tuple[int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if total % world:
        fits = [d for d in range(1, total + 1) if total % d == 0 and d <= 64]
        raise ValueError(
            f"{what} ({total}) is not divisible by the tensor-parallel size ({world}); "
            f"use a tp size in {fits}, or pad {what} to a multiple of {world}."
        )
    size = total // world
    return size, rank * size


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return value


def _int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}.")
    return value


def _check_dim(x: torch.Tensor, dim: int, name: str) -> None:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{name}={dim} is not a dimension of the {x.dim()}-d input {tuple(x.shape)}; "
            "pass the index of the sequence dimension (1 for [batch, sequence, hidden])."
        )


_Layer = TypeVar("_Layer", bound="_FromLayer")


class _FromLayer(nn.Module):
    """The constructors both parallel linears share: from an ``nn.Linear``
    or from GPT-2's ``Conv1D`` (weight stored ``[in, out]``); ``options``
    are the class's constructor options."""

    @classmethod
    def from_linear(
        cls: type[_Layer], layer: nn.Linear, group: dist.ProcessGroup, **options: Any
    ) -> _Layer:
        make: Any = cls  # each subclass takes (weight, bias, group, **options)
        built: _Layer = make(layer.weight, layer.bias, group, **options)
        return built

    @classmethod
    def from_conv1d(
        cls: type[_Layer], layer: nn.Module, group: dist.ProcessGroup, **options: Any
    ) -> _Layer:
        weight: Any = layer.weight
        make: Any = cls
        built: _Layer = make(weight.t(), getattr(layer, "bias", None), group, **options)
        return built


class ColumnParallelLinear(_FromLayer):
    """``y = x W^T + b`` with ``W``'s output rows split over ``group``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        input_gathered: bool = False,
        sequence_dim: int = 1,
        parts: int = 1,
        valid_out_features: int | None = None,
    ) -> None:
        super().__init__()
        gather_output = _flag(gather_output, "gather_output")
        sequence_parallel = _flag(sequence_parallel, "sequence_parallel")
        input_gathered = _flag(input_gathered, "input_gathered")
        sequence_dim = _int(sequence_dim, "sequence_dim", -8)
        parts = _int(parts, "parts", 1)
        if valid_out_features is not None:
            valid_out_features = _int(valid_out_features, "valid_out_features", 1)
        if input_gathered and sequence_parallel:
            raise ValueError(
                "input_gathered and sequence_parallel do not combine: input_gathered says "
                "the caller already gathered the sequence with gather_sequence."
            )
        if gather_output and sequence_parallel:
            raise ValueError(
                "gather_output and sequence_parallel do not combine: under sequence "
                "parallelism the column layer's input is gathered along the sequence and "
                "its output stays split by features for the row layer that follows."
            )
        out_features = weight.shape[0]
        if out_features % parts:
            raise ValueError(
                f"parts={parts} must be a positive divisor of out_features ({out_features})."
            )
        what = "out_features" if parts == 1 else f"out_features of each of the {parts} parts"
        size, start = _shard_size(out_features // parts, group, what)
        self.group = group
        self.gather_output = gather_output
        # Input split along the sequence (dim 1); gathered here, its
        # gradient reduce-scattered back.
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        # Input gathered by the caller with gather_sequence, whose backward
        # already sums the gradient over the group: no copy_to_tp here.
        self.input_gathered = input_gathered
        self.in_features, self.out_features = weight.shape[1], out_features
        # A fused projection (GPT-2's q|k|v) is ``parts`` stacked blocks of
        # rows; each rank takes its slice of every block, in order.
        rows = torch.cat(
            [p[start : start + size] for p in weight.detach().chunk(parts, dim=0)], dim=0
        )
        self.weight = nn.Parameter(rows.clone())
        self.bias = (
            nn.Parameter(
                torch.cat([p[start : start + size] for p in bias.detach().chunk(parts)]).clone()
            )
            if bias is not None
            else None
        )
        # Outputs at or past ``valid_out_features`` are padding (a vocabulary
        # padded to a multiple of the group size): their logits read -inf.
        self.valid_out_features = valid_out_features
        self._invalid: torch.Tensor | None = None
        if valid_out_features is not None and parts == 1:
            local = torch.arange(start, start + size, device=weight.device)
            if int(local[-1]) >= valid_out_features:
                self._invalid = local >= valid_out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            _check_dim(x, self.sequence_dim, "sequence_dim")
            x = gather_sequence(x, self.group, self.sequence_dim)
        elif not self.input_gathered:
            x = copy_to_tp(x, self.group)
        out = nn.functional.linear(x, self.weight, self.bias)
        if self._invalid is not None:
            out = out.masked_fill(self._invalid.to(out.device), float("-inf"))
        return gather_from_tp(out, self.group) if self.gather_output else out


class RowParallelLinear(_FromLayer):
    """``y = x W^T + b`` with ``W``'s input columns split over ``group``;
    the input arrives already split (the output of a column-parallel layer)
    unless ``input_is_parallel=False``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> None:
        super().__init__()
        input_is_parallel = _flag(input_is_parallel, "input_is_parallel")
        sequence_parallel = _flag(sequence_parallel, "sequence_parallel")
        sequence_dim = _int(sequence_dim, "sequence_dim", -8)
        in_features = weight.shape[1]
        size, start = _shard_size(in_features, group, "in_features")
        self.group = group
        self.input_is_parallel = input_is_parallel
        # Output reduce-scattered along the sequence (dim 1) instead of
        # all-reduced: each rank keeps its sequence slice.
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.weight = nn.Parameter(weight.detach()[:, start : start + size].clone())
        # The bias is added once, after the sum, so every rank holds all of it.
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            # The whole input is the same on every rank: backward gathers the
            # slices' gradients so the replicated computation before sees all of it.
            x = split_to_tp(x, self.group, dim=-1)
        partial = nn.functional.linear(x, self.weight)
        if self.sequence_parallel:
            _check_dim(partial, self.sequence_dim, "sequence_dim")
            out = reduce_scatter_sequence(partial, self.group, self.sequence_dim)
        else:
            out = reduce_from_tp(partial, self.group)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over ``group``."""

    def __init__(
        self,
        weight: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        padded_size: int | None = None,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        vocab = weight.shape[0]
        if padding_idx is not None:
            padding_idx = _int(padding_idx, "padding_idx", -vocab)
            if padding_idx >= vocab:
                raise ValueError(f"padding_idx must be below the vocabulary ({vocab}).")
            padding_idx %= vocab  # nn.Embedding counts a negative one from the end
        # As nn.Embedding's: that row's lookups pass no gradient to it.
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = weight.shape
        if padded_size is not None:
            padded_size = _int(padded_size, "padded_size", 1)
        if padded_size is not None and padded_size != vocab:
            # Zero rows past the vocabulary so it splits evenly; no id ever
            # reaches them, so they receive no gradient and stay zero.
            if padded_size < vocab:
                raise ValueError(
                    f"padded_size ({padded_size}) is smaller than the vocabulary ({vocab})."
                )
            world = dist.get_world_size(group)
            if padded_size - vocab >= max(vocab, 128 * world):
                raise ValueError(
                    f"padded_size ({padded_size}) adds more rows than the vocabulary ({vocab}) "
                    "has: padding only makes the vocabulary divisible by the tensor-parallel "
                    f"size ({world}); round {vocab} up to a multiple of it."
                )
            pad = weight.new_zeros(padded_size - weight.shape[0], weight.shape[1])
            weight = torch.cat([weight.detach(), pad])
        size, start = _shard_size(weight.shape[0], group, "the vocabulary size")
        self.group = group
        self.start, self.end = start, start + size
        self.weight = nn.Parameter(weight.detach()[start : start + size].clone())

    @classmethod
    def from_embedding(
        cls, layer: nn.Embedding, group: dist.ProcessGroup, *, padded_size: int | None = None
    ) -> VocabParallelEmbedding:
        if layer.max_norm is not None or layer.scale_grad_by_freq or layer.sparse:
            raise ValueError(
                "VocabParallelEmbedding supports padding_idx but not max_norm, "
                "scale_grad_by_freq or sparse embeddings."
            )
        built = cls(layer.weight, group, padded_size=padded_size, padding_idx=layer.padding_idx)
        scale = getattr(layer, "embed_scale", None)
        if scale is not None:  # transformers' scaled embeddings (Gemma 3): lookups * scale
            built.register_buffer(
                "embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False
            )
        return built

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        pad = self.padding_idx
        mine = pad is not None and self.start <= pad < self.end
        out = nn.functional.embedding(
            local, self.weight, padding_idx=pad - self.start if mine and pad is not None else None
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_from_tp(out, self.group)
        scale = getattr(self, "embed_scale", None)
        return out * scale.to(self.weight.dtype) if scale is not None else out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        start: int,
        ignore_index: int,
        divisor: torch.Tensor | None,
    ) -> torch.Tensor:
        logits = logits.float()
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        size = logits.shape[-1]
        ignored = target == ignore_index
        local = target - start
        mine = (local >= 0) & (local < size) & ~ignored
        index = local.clamp(0, size - 1).unsqueeze(-1)
        # where, not a product: a padded vocabulary column holds -inf.
        picked = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)
        dist.all_reduce(picked, group=group)
        losses = (total.log() - picked).masked_fill(ignored, 0.0)
        count = (~ignored).sum().clamp(min=1) if divisor is None else divisor
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, mine, ignored, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        softmax, index, mine, ignored, count = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, index, -mine.to(out.dtype).unsqueeze(-1))
        out.masked_fill_(ignored.unsqueeze(-1), 0.0)
        return out * (grad / count), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    ignore_index: int = -100,
    num_items: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored targets, from ``logits``
    holding this rank's contiguous slice of the vocabulary (``[..., V/tp]``,
    slice ``rank``). Only three reductions of one number per token cross the
    group; the full logits never exist anywhere. With ``num_items`` the sum
    is divided by it instead of by the count of targets (``transformers``'
    ``num_items_in_batch`` under gradient accumulation)."""
    start = dist.get_rank(group) * logits.shape[-1]
    divisor = None if num_items is None else torch.as_tensor(num_items, device=logits.device)
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call, unused-ignore]
        logits, target, group, start, ignore_index, divisor
    )
    return loss
