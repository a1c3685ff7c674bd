"""The dynamic loss scale for fp16 training.

[Note: dynamic loss scale]
The loss is multiplied by ``scale`` before backward so small fp16 gradients
do not flush to zero; the optimizer divides it back out in fp32. When any
rank finds a non-finite gradient, every rank skips the step (the decision is
all-reduced, so no rank steps alone) and, after ``hysteresis`` consecutive
overflows, the scale is multiplied by ``backoff_factor`` (never below
``min_scale``). After ``growth_interval`` clean steps in a row it is
multiplied by ``growth_factor`` (never above ``max_scale``). The names and
defaults are Colossal-AI's; ``hysteresis=1`` gives torch's GradScaler rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import Communicator, ReduceOp

__all__ = ["DynamicLossScaler", "LossScaleConfig", "unscale_clip_and_check"]


@dataclass(frozen=True)
class LossScaleConfig:
    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    max_scale: float = 2.0**32
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                "loss scale: expected 0 < min_scale <= initial_scale <= max_scale, got "
                f"{self.min_scale}, {self.initial_scale}, {self.max_scale}."
            )
        if self.growth_factor < 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"loss scale: expected growth_factor >= 1 and 0 < backoff_factor < 1, got "
                f"{self.growth_factor} and {self.backoff_factor}."
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                f"loss scale: growth_interval ({self.growth_interval}) and hysteresis "
                f"({self.hysteresis}) must be at least 1."
            )


def unscale_clip_and_check(
    grads: list[torch.Tensor],
    comm: Communicator,
    scaler: DynamicLossScaler | None,
    max_norm: float,
    device: torch.device,
    *,
    count_ranges: list[list[tuple[int, int]]] | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[bool, float]:
    """Unscaling, the overflow check (any rank) and global-norm clipping of
    this rank's fp32 gradient shards, shared by every ZeRO stage: one norm
    per tensor, one all-reduce of the sum of squares (on ``device``), then
    one multiply per tensor. A non-finite gradient anywhere makes that sum
    inf or NaN (squares of fp32 values cannot overflow fp64), so it is also
    the overflow flag; on overflow the scaler backs off and nothing is
    changed. Returns (step may proceed, unscaled global norm).

    Under tensor parallelism, ``count_ranges[i]`` lists the ranges of
    ``grads[i]`` that count (each parameter once across the group) and the
    sum of squares is also reduced over ``tp_group``."""
    if scaler is None and max_norm == 0:
        return True, math.nan
    if count_ranges is not None:
        parts = [
            g[lo:hi] for g, ranges in zip(grads, count_ranges, strict=True) for lo, hi in ranges
        ]
    else:
        parts = list(grads)
    if parts:
        norms = torch.stack([torch.linalg.vector_norm(g).to(device) for g in parts])
        squares = norms.double().square().sum().reshape(1)
    else:
        squares = torch.zeros(1, dtype=torch.float64, device=device)
    comm.all_reduce(squares, ReduceOp.SUM)
    if tp_group is not None:
        dist.all_reduce(squares, group=tp_group)
    total = float(squares)
    if scaler is not None and not math.isfinite(total):
        scaler.update(True)
        return False, math.inf
    scale = scaler.scale if scaler is not None else 1.0
    norm = math.sqrt(total) / scale
    factor = 1.0 / scale
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            factor *= coef
    if factor != 1.0:
        for grad in grads:
            grad.mul_(factor)
    return True, norm


class DynamicLossScaler:
    """The scale and its bookkeeping [Note: dynamic loss scale]."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = self.config.initial_scale
        # Clean steps since the last overflow or growth, for growth_interval.
        self.good_steps = 0
        # Overflows still tolerated before the scale backs off.
        self.hysteresis_left = self.config.hysteresis

    def update(self, overflow: bool) -> None:
        c = self.config
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(c.min_scale, self.scale * c.backoff_factor)
                self.hysteresis_left = c.hysteresis
            return
        self.good_steps += 1
        if self.good_steps >= c.growth_interval:
            self.scale = min(c.max_scale, self.scale * c.growth_factor)
            self.good_steps = 0
            self.hysteresis_left = c.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
