"""Gradient clipping for the optimizers that step the user's parameters
themselves: a step pre-hook that clips by the global norm (replicated or
DTensor gradients), and the one-step clip of ``clip_grad_by_norm`` for
optimizers that clip inside their step (pc-zero's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["clip_at_next_step", "clip_hook", "clip_replicated", "refuse_error_if_nonfinite"]


def clip_hook(
    max_norm: float, clip: Callable[[Sequence[torch.Tensor], float], float]
) -> Callable[[Optimizer, Any, Any], None]:
    """An optimizer step pre-hook that clips the gradients of the
    optimizer's parameters (those that have one) by their global norm
    (``clip(params, max_norm)`` computes it over every group that holds a
    piece of them) before each step."""

    def hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        clip(params, max_norm)

    return hook


def clip_replicated(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip gradients every rank holds whole (after DDP's all-reduce), or
    FSDP2's DTensor gradients, whose norm torch reduces over the shards."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def refuse_error_if_nonfinite(plugin: Any, error_if_nonfinite: bool) -> None:
    """``clip_grad_by_norm(error_if_nonfinite=True)`` where the norm is
    only known inside the step (sharded or still-reducing gradients)."""
    if error_if_nonfinite:
        raise ValueError(
            f"{type(plugin).__name__}: clip_grad_by_norm(error_if_nonfinite=True): the "
            "gradients' norm is computed inside the step here, after backward returns; a "
            "non-finite norm skips the step (fp16) or is caught by pc-train's --check-finite. "
            "Pass error_if_nonfinite=False."
        )


def clip_at_next_step(optimizer: Any, attribute: str, max_norm: float) -> None:
    """``optimizer.clip_grad_by_norm(max_norm)`` for an optimizer that
    clips inside its step (a pc-zero optimizer: its gradients are sharded
    or still being reduced when backward returns): its ``attribute`` (the
    max norm it clips by, 0 for none) becomes ``max_norm`` for the next
    step only (the smaller of the two when it already clips)."""
    restore = optimizer.__dict__.get("_pc_clip_restore")
    if restore is None:
        before = float(getattr(optimizer, attribute))

        def put_back(opt: Any, args: Any, kwargs: Any) -> None:
            setattr(optimizer, attribute, before)
            del optimizer.__dict__["_pc_clip_restore"]
            handle.remove()

        handle = optimizer.register_step_post_hook(put_back)
        optimizer.__dict__["_pc_clip_restore"] = before
        restore = before
    setattr(optimizer, attribute, min(max_norm, restore) if restore > 0 else max_norm)
