"""Gradient clipping by the global norm where every rank holds whole
gradients or FSDP2's DTensor shards (a :class:`~pc_booster.step_policies.Clip`
for the step policy, [Note: one step policy])."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["clip_replicated"]


def clip_replicated(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip gradients every rank holds whole (after DDP's all-reduce), or
    FSDP2's DTensor gradients, whose norm torch reduces over the shards."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
