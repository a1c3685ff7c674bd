"""The dynamic loss scale for fp16 training.

[Note: dynamic loss scale]
The loss is multiplied by ``scale`` before backward so small fp16 gradients
do not flush to zero; the optimizer divides it back out in fp32. When any
rank finds a non-finite gradient, every rank skips the step (the decision is
all-reduced, so no rank steps alone) and, after ``hysteresis`` consecutive
overflows, the scale is multiplied by ``backoff_factor`` (never below
``min_scale``). After ``growth_interval`` clean steps in a row it is
multiplied by ``growth_factor`` (never above ``max_scale``). The names and
defaults are those of docs/packages/pc-zero.md; ``hysteresis=1`` gives torch's GradScaler rule.

[Note: global norm across groups]
Clipping and the overflow decision must be the same on every rank that
trains one model, or the replicas drift apart. The global norm is the
square root of the sum, over every element of every parameter of the whole
model, of its gradient squared. Each rank sums the squares of what it holds
and the sums are all-reduced: over the data-parallel communicator when the
ranks hold disjoint shards of the same gradients (ZeRO), then over each
model-parallel group, whose ranks hold different parameters (tensor-parallel
shards, pipeline stages). An element that several model-parallel ranks
hold (a replicated parameter under tensor parallelism, a weight tied between
the first and last pipeline stage) must count on exactly one of them:
``count_ranges`` says which elements count here. The others still join the
overflow check as ``0 * square``, which is 0 when finite and NaN when not, so
an inf that only one holder sees still stops every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import Communicator, ReduceOp

__all__ = [
    "DynamicLossScaler",
    "LossScaleConfig",
    "NonFiniteGradientError",
    "counts_under_tensor_parallel",
    "norm_groups",
    "unscale_clip_and_check",
]

_NORM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class NonFiniteGradientError(FloatingPointError):
    """Gradients to clip whose global norm is inf or NaN, without a loss
    scale to skip the step on: clipping by that norm would multiply every
    gradient by NaN (or zero them all) and the step would write garbage
    over good weights, so nothing is changed and this is raised on every
    rank (the norm is all-reduced, so every rank sees it)."""

    def __init__(self, norm: float) -> None:
        self.norm = norm
        super().__init__(
            f"the gradients' global norm is {norm}: a gradient is inf or NaN, so they were "
            "not clipped and the step was not applied (the weights are unchanged). Find the "
            "cause (learning rate, data, an overflow in bf16) and resume from a checkpoint; "
            "fp16 with a loss scale skips such steps instead."
        )


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
    grads: Sequence[torch.Tensor],
    comm: Communicator | None,
    scaler: DynamicLossScaler | None,
    max_norm: float,
    device: torch.device,
    *,
    count_ranges: Sequence[Sequence[tuple[int, int]]] | None = None,
    model_parallel_groups: Sequence[dist.ProcessGroup] = (),
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[bool, float]:
    """Unscaling, the overflow check (any rank) and global-norm clipping of
    this rank's fp32 gradients, shared by every ZeRO stage and by plain
    optimizers under model parallelism [Note: global norm across groups]:
    one norm per tensor, one all-reduce of the sum of squares per group (on
    ``device``), then one multiply per tensor. A non-finite gradient
    anywhere makes that sum inf or NaN (squares of fp32 values cannot
    overflow fp64), so it is also the overflow flag; on overflow the scaler
    backs off and nothing is changed; without a scaler, a non-finite norm
    raises :class:`NonFiniteGradientError` and nothing is changed. Returns
    (step may proceed, unscaled global norm).

    ``comm``: the data-parallel ranks that each hold a shard of the same
    gradients (their sums add up), or None where this rank's gradients are
    whole (a plain optimizer after DDP's all-reduce: every data-parallel
    rank already holds the same sum). fp16/bf16 gradients are normed in
    fp32. ``model_parallel_groups``: the groups over
    which the parameters themselves differ (tensor-parallel shards,
    pipeline stages); the sum is all-reduced over each in turn, after
    ``comm``. ``tp_group`` is the older spelling of one such group (added to
    them). ``count_ranges[i]``: the ranges of ``grads[i]``'s flattened
    elements that count towards the norm on this rank, so that a parameter
    held by several model-parallel ranks (replicated under tensor
    parallelism, tied across pipeline stages) counts once: ``[(0,
    g.numel())]`` for a whole tensor, ``[]`` for none. The elements left out
    still take part in the overflow check."""
    if scaler is None and max_norm == 0:
        return True, math.nan
    total = reduced_squares(
        grads, comm, device, norm_groups(model_parallel_groups, tp_group),
        count_ranges=count_ranges, check_all=scaler is not None,
    )  # fmt: skip
    if scaler is not None and not math.isfinite(total):
        scaler.update(True)
        return False, math.inf
    if not math.isfinite(total):  # nothing to skip the step on [NonFiniteGradientError]
        raise NonFiniteGradientError(total)
    factor, norm = step_factor(total, scaler.scale if scaler is not None else 1.0, max_norm)
    if factor != 1.0:
        for grad in grads:
            grad.mul_(factor)
    return True, norm


def reduced_squares(
    grads: Sequence[torch.Tensor],
    comm: Communicator | None,
    device: torch.device,
    groups: Sequence[dist.ProcessGroup],
    *,
    count_ranges: Sequence[Sequence[tuple[int, int]]] | None = None,
    check_all: bool = True,
) -> float:
    """The sum of squares of the counted elements of ``grads`` over this
    rank, ``comm`` and each of ``groups`` in turn (inf or NaN when any
    element anywhere is not finite, with ``check_all``): the squared norm
    of the gradients they hold together [Note: global norm across groups]."""
    squares = _local_squares(grads, count_ranges, device, check_all=check_all)
    if comm is not None:
        comm.all_reduce(squares, ReduceOp.SUM)
    for group in groups:
        dist.all_reduce(squares, group=group)
    return float(squares)


def step_factor(total: float, scale: float, max_norm: float) -> tuple[float, float]:
    """From the gradients' squared global norm ``total`` at loss scale
    ``scale`` (finite): the factor that unscales them and clips them to
    ``max_norm`` (0: no clip), and their unscaled norm."""
    norm = math.sqrt(total) / scale
    factor = 1.0 / scale
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            factor *= coef
    return factor, norm


def norm_groups(
    model_parallel_groups: Sequence[dist.ProcessGroup], tp_group: dist.ProcessGroup | None
) -> list[dist.ProcessGroup]:
    """The groups the squared norm is all-reduced over after the
    data-parallel ranks: ``model_parallel_groups`` (each once, or
    ``ValueError``), then ``tp_group`` unless already among them."""
    groups = list(model_parallel_groups)
    for k, group in enumerate(groups):
        if any(group is other for other in groups[:k]):
            raise ValueError(
                "model_parallel_groups lists one process group twice; the squared norm "
                "would be summed over it twice. Pass each group once."
            )
    if tp_group is not None and not any(tp_group is g for g in groups):
        groups.append(tp_group)
    return groups


def counts_under_tensor_parallel(tp_group: dist.ProcessGroup) -> Callable[[torch.Tensor], bool]:
    """Whether this rank counts a parameter towards the global norm under
    tensor parallelism [Note: global norm across groups]: one sharded over
    ``tp_group`` (marked ``tensor_model_parallel`` by pc_tensor) on every
    rank of it, a replicated one (the same on every rank) on its rank 0
    only."""
    first = dist.get_rank(tp_group) == 0

    def counts(param: torch.Tensor) -> bool:
        return first or bool(getattr(param, "tensor_model_parallel", False))

    return counts


def _local_squares(
    grads: Sequence[torch.Tensor],
    count_ranges: Sequence[Sequence[tuple[int, int]]] | None,
    device: torch.device,
    *,
    check_all: bool,
) -> torch.Tensor:
    """This rank's sum of squares (fp64, shape (1,), on ``device``) over the
    counted elements. With ``check_all``, the uncounted elements add
    ``0 * their squares``: nothing when finite, NaN when not, so an
    overflow there is seen too [Note: global norm across groups]."""
    other: list[torch.Tensor] = []
    if count_ranges is None:
        counted = list(grads)
    else:
        counted, other = _split_ranges(grads, count_ranges)
    squares = _sum_of_squares(counted, device)
    if check_all and other:
        squares += _sum_of_squares(other, device) * 0.0
    return squares


def _split_ranges(
    grads: Sequence[torch.Tensor], count_ranges: Sequence[Sequence[tuple[int, int]]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The counted ranges of each gradient's flattened elements, and the
    rest."""
    counted: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    for grad, ranges in zip(grads, count_ranges, strict=True):
        flat = grad.reshape(-1)
        at = 0
        for lo, hi in sorted(ranges):
            if at < lo:
                other.append(flat[at:lo])
            counted.append(flat[lo:hi])
            at = max(at, hi)
        if at < flat.numel():
            other.append(flat[at:])
    return counted, other


def _sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(1, dtype=torch.float64, device=device)
    # fp16/bf16 gradients (plain optimizers) are normed in fp32: their own
    # range overflows at a norm of 65504 (fp16) where the gradients do not.
    norms = torch.stack(
        [torch.linalg.vector_norm(t, dtype=_NORM_DTYPE.get(t.dtype)).to(device) for t in tensors]
    )
    return norms.double().square().sum().reshape(1)


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
