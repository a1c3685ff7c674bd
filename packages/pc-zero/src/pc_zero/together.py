"""ZeRO optimizers stepped as one: one global gradient norm and one fp16
overflow decision across them [Note: a step in two halves], for a model
whose parameters are sharded over different groups (an expert-parallel
model's dense parameters over the data-parallel ranks, its experts over the
ranks holding the same experts)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pc_zero.loss_scale import NonFiniteGradientError, step_factor
from pc_zero.low_level_zero import LowLevelZeroOptimizer

__all__ = ["step_together"]


def step_together(optimizers: Sequence[LowLevelZeroOptimizer]) -> float:
    """Step every optimizer of ``optimizers`` on its gradients, unscaled by
    their common loss scale and clipped by the global norm of all of them
    together (the first one's ``max_norm``, or its ``clip_next_step``), or
    skip every step when any gradient anywhere overflowed (fp16). Each
    optimizer's squared norm is summed over the ranks that hold its
    parameters, so the total counts every parameter once. Returns the
    unscaled global norm (nan when neither clipping nor fp16 needed it, inf
    on overflow); a non-finite norm without fp16's loss scale skips every
    step and raises :class:`~pc_zero.NonFiniteGradientError`."""
    if not optimizers:
        raise ValueError("step_together: no optimizers given.")
    lead = optimizers[0]
    scales = {o.loss_scale for o in optimizers}
    norms = {o._step_max_norm() for o in optimizers}
    if len(scales) > 1 or len(norms) > 1 or len({o.scaler is None for o in optimizers}) > 1:
        raise ValueError(
            "step_together: the optimizers disagree on the loss scale or the clip norm "
            f"(scales {sorted(scales)}, max_norm {sorted(norms)}); build them with the same "
            "loss-scale settings and max_norm."
        )
    grads = [o.step_gradients() for o in optimizers]
    (max_norm,) = norms
    if lead.scaler is None and max_norm == 0:
        for o, g in zip(optimizers, grads, strict=True):
            o.step_with(g, 1.0)
        return math.nan
    total = sum(o.gradient_squares(g) for o, g in zip(optimizers, grads, strict=True))
    if not math.isfinite(total):
        for o in optimizers:
            o.skip_step()  # each backs its loss scale off (fp16)
        if lead.scaler is None:  # nothing to skip on: refused [NonFiniteGradientError]
            raise NonFiniteGradientError(total)
        return math.inf
    factor, norm = step_factor(total, lead.loss_scale, max_norm)
    for o, g in zip(optimizers, grads, strict=True):
        o.step_with(g, factor)
    return norm
