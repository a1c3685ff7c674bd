"""``sequence_attention``: one of pc's sequence-parallel attentions chosen by
its mode name (the names: docs/migrate-colossalai.md), above both (:mod:`pc_tensor.ulysses` for
``"all_to_all"``, :mod:`pc_tensor.ring` for ``"ring_attn"``), which share
:mod:`pc_tensor.sequence` below them."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from pc_tensor.ring import RING_ATTENTION, prepare_links, ring_attention
from pc_tensor.sequence import attend
from pc_tensor.ulysses import ATTENTION, ulysses_attention

__all__ = ["sequence_attention"]


def sequence_attention(model: nn.Module, group: dist.ProcessGroup, mode: str) -> nn.Module:
    """Only the attention of :func:`~pc_tensor.ulysses_model`
    (``mode="all_to_all"``) or :func:`~pc_tensor.ring_model`
    (``"ring_attn"``) over ``group``, leaving the model's forward as it is:
    for callers that split the sequence themselves (pipeline stages, with
    :func:`~pc_tensor.sequence_positions` and
    :func:`~pc_tensor.sequence_lm_loss`). Returns the model."""
    if mode == "all_to_all":
        attend(model, group, (ATTENTION, ulysses_attention))
    elif mode == "ring_attn":
        attend(model, group, (RING_ATTENTION, ring_attention))
        prepare_links(model)
    else:
        raise ValueError(f"mode must be 'all_to_all' or 'ring_attn', got {mode!r}.")
    return model
