"""The gradient step a :class:`~pc_booster.wrappers.BoostedOptimizer` runs:
one :class:`GradientStep` per boosted optimizer, made by the plugin that
boosted it [Note: one step policy].

[Note: one step policy]
Every boosted optimizer steps in one order: the loss scaled in backward
(fp16 without a pc-zero optimizer: :class:`AmpStep`), the gradients
unscaled once, clipped (``clip_grad_by_norm``'s norm for this step, then
the plugin's ``max_norm`` at the step), checked for overflow, then the step
applied or skipped. How a clip is computed is the plugin's: a function over
the gradients this rank holds that reduces the norm over every group
holding a piece of them (whole after DDP's all-reduce, FSDP2's DTensor
shards, tensor x pipeline pieces), or, for an optimizer that clips inside
its own step because its gradients are sharded or still being reduced when
backward returns (pc-zero's ``ClipsInStep``), that optimizer's own
``clip_next_step``. Nothing is written on the optimizer, and no registry
keeps it: the policy lives in the wrapper ``boost`` returns."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pc_zero import DynamicLossScaler, LossScaleConfig, unscale_clip_and_check

__all__ = ["AmpStep", "Clip", "GradientStep"]

#: clips the gradients of the given parameters to a global norm of at most
#: the given max norm, over every rank holding a piece of them; returns the
#: norm before clipping
Clip = Callable[[Sequence[torch.Tensor], float], float]


@runtime_checkable
class ClipsInStep(Protocol):
    """An optimizer that clips inside its own step (pc-zero's)."""

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step's gradients to at most ``max_norm`` too."""


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

    def skip(self, optimizer: Optimizer) -> tuple[bool, Any]:
        """This step overflowed: its gradients are dropped (the scale backed
        off when it was unscaled)."""
        self.unscaled = None
        optimizer.zero_grad(set_to_none=True)
        return False, None

    def stepped(self) -> None:
        """This step was applied: the scale may grow."""
        self.unscaled = None
        self.scaler.update(False)


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's local values (a DTensor's shard on this rank)."""
    if grad is None:
        return None
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _with_grads(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class GradientStep:
    """One boosted optimizer's step [Note: one step policy].

    ``norm``: how its gradients are clipped, or None where the optimizer
    clips inside its own step (pc-zero's); ``max_norm``: the plugin's clip
    at every step (0: none; an optimizer that clips itself was given it);
    ``amp``: fp16's loss scale where the optimizer does not keep one;
    ``owner``: the plugin's name, for errors; ``no_clip``: why
    ``clip_grad_by_norm`` cannot be done (None: it can)."""

    def __init__(
        self,
        owner: str,
        norm: Clip | None = None,
        max_norm: float = 0.0,
        amp: AmpStep | None = None,
        no_clip: str | None = None,
    ) -> None:
        self.owner = owner
        self.norm = norm
        self.max_norm = max_norm
        self.amp = amp
        # Why clip_grad_by_norm cannot be done here (None: it can).
        self.no_clip = no_clip

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on (the loss times fp16's loss scale)."""
        return self.amp.scale_loss(loss) if self.amp is not None else loss

    def unscale(self, optimizer: Optimizer) -> bool:
        """This step's gradients at their true size (once); False when they
        overflowed (the step will be skipped)."""
        return self.amp.unscale(optimizer) if self.amp is not None else True

    def clip(self, optimizer: Optimizer, max_norm: float, error_if_nonfinite: bool) -> None:
        """``clip_grad_by_norm(max_norm)``: this step's (unscaled) gradients."""
        if self.no_clip is not None:
            raise ValueError(f"{self.owner}: {self.no_clip}")
        if self.norm is None:
            if error_if_nonfinite:
                raise ValueError(
                    f"{self.owner}: clip_grad_by_norm(error_if_nonfinite=True): the gradients' "
                    "norm is computed inside the step here, after backward returns; a "
                    "non-finite norm skips the step (fp16) or is caught by pc-train's "
                    "--check-finite. Pass error_if_nonfinite=False."
                )
            if not isinstance(optimizer, ClipsInStep):
                raise TypeError(f"{self.owner}: {type(optimizer).__name__} does not clip itself")
            optimizer.clip_next_step(max_norm)
            return
        total = self.norm(_with_grads(optimizer), max_norm)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"clip_grad_by_norm: the gradients' total norm is {total} "
                "(error_if_nonfinite=True)."
            )

    def step(self, optimizer: Optimizer, closure: Any) -> tuple[bool, Any]:
        """Unscale, skip on overflow, clip by ``max_norm``, step: (applied, result)."""
        if self.amp is not None and not self.amp.unscale(optimizer):
            return self.amp.skip(optimizer)
        if self.norm is not None and self.max_norm > 0:
            self.norm(_with_grads(optimizer), self.max_norm)
        result = optimizer.step(closure)
        if self.amp is not None:
            self.amp.stepped()
        return True, result
