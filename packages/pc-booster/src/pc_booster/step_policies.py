"""Gradient-step policies a :class:`~pc_booster.wrappers.BoostedOptimizer`
runs for plugins whose optimizer is a plain torch one (the user's, or one
rebuilt over sharded parameters) [Note: boosted optimizer]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pc_zero import DynamicLossScaler, LossScaleConfig, unscale_clip_and_check

__all__ = ["AmpStep"]


class AmpStep:
    """fp16 compute with fp32 parameters, as torch's ``GradScaler`` does it:
    backward runs on the loss times a dynamic loss scale; before the step
    (or before clipping, whichever comes first) the gradients are divided by
    it and checked; a step whose gradients overflowed on any rank is skipped
    (its gradients dropped) and the scale backs off, else the optimizer's
    own step runs and the scale may grow.

    ``groups``: where the gradients are sharded (FSDP2's DTensor shards),
    the ranks over which the overflow check and norm are all-reduced; empty
    where every rank holds the same whole gradients (after DDP's
    all-reduce)."""

    def __init__(
        self,
        config: LossScaleConfig,
        device: torch.device,
        groups: Sequence[dist.ProcessGroup] = (),
    ) -> None:
        # The dynamic loss scale: its value now, growth and back-off.
        self.scaler = DynamicLossScaler(config)
        # Where the overflow check's sum is reduced (the gradients' device).
        self.device = device
        # The groups the gradients are sharded over (none: whole on every rank).
        self.groups = tuple(groups)
        # This step's verdict once unscaled (None: not unscaled yet), so that
        # clip_grad_by_norm before step does not unscale twice.
        self.unscaled: bool | None = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def unscale(self, optimizer: Optimizer) -> bool:
        if self.unscaled is None:
            grads = [_local(p.grad) for g in optimizer.param_groups for p in g["params"]]
            present = [g for g in grads if g is not None]
            ok, _ = unscale_clip_and_check(
                present, None, self.scaler, 0.0, self.device, model_parallel_groups=self.groups
            )
            self.unscaled = ok
        return self.unscaled

    def step(self, optimizer: Optimizer, closure: Any) -> tuple[bool, Any]:
        ok = self.unscale(optimizer)
        self.unscaled = None
        if not ok:  # the scale backed off; this step's gradients are dropped
            optimizer.zero_grad(set_to_none=True)
            return False, None
        result = optimizer.step(closure)
        self.scaler.update(False)
        return True, result


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's local values (a DTensor's shard on this rank)."""
    if grad is None:
        return None
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad
