"""``colossalai.nn.lr_scheduler``: Colossal-AI's learning-rate schedulers
under their names and call shapes: ``Scheduler(optimizer, total_steps,
...)``, stepped once per optimizer step.

Each is a ``torch.optim.lr_scheduler.LRScheduler``, so ``state_dict`` /
``load_state_dict``, ``get_last_lr`` and the Booster's re-pointing of a
scheduler at the boosted optimizer work as for torch's own. ``lr`` at
construction (before the first ``step()``) is the value for the first
optimizer step, as in torch.

[Note: schedules in closed form]
The warmup schedulers compute the learning rate of step ``k`` from ``k``
alone (``_lr_at``), rather than chaining a warmup scheduler in front of a
second one as Colossal-AI does. One scheduler holds all the state, so its
state dict is torch's plain one, and ``step(epoch)`` lands on the right
value. The values are Colossal-AI's, step for step, except where theirs
divide by zero or turn negative (documented on each class).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR as _TorchCosineAnnealingLR
from torch.optim.lr_scheduler import ExponentialLR as _TorchExponentialLR
from torch.optim.lr_scheduler import LambdaLR as _TorchLambdaLR
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.lr_scheduler import MultiplicativeLR as _TorchMultiplicativeLR
from torch.optim.lr_scheduler import MultiStepLR as _TorchMultiStepLR
from torch.optim.lr_scheduler import OneCycleLR as _TorchOneCycleLR
from torch.optim.lr_scheduler import StepLR as _TorchStepLR

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]

LR: TypeAlias = float | Tensor  # torch allows a tensor learning rate per group


def _check_steps(name: str, total_steps: int, warmup_steps: int = 0) -> None:
    if total_steps <= 0:
        raise ValueError(
            f"{name}: expected total_steps > 0, got {total_steps}. Pass the number of "
            "optimizer steps the schedule spans."
        )
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"{name}: expected 0 <= warmup_steps <= total_steps ({total_steps}), got "
            f"warmup_steps={warmup_steps}."
        )


class _ClosedFormLR(LRScheduler):
    """A schedule given by the learning rate of each step
    [Note: schedules in closed form]."""

    def get_lr(self) -> list[LR]:
        return self._get_closed_form_lr()

    def _get_closed_form_lr(self) -> list[LR]:
        return [self._lr_at(base_lr, self.last_epoch) for base_lr in self.base_lrs]

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        raise NotImplementedError


class CosineAnnealingLR(_TorchCosineAnnealingLR):
    """Cosine from each group's ``lr`` down to ``eta_min`` over
    ``total_steps``: torch's ``CosineAnnealingLR`` with ``T_max=total_steps``
    (past ``total_steps`` the cosine rises again, as torch's does)."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        eta_min: float = 0.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, T_max=total_steps, eta_min=eta_min, last_epoch=last_epoch)


class CosineAnnealingWarmupLR(_ClosedFormLR):
    """Linear warmup over ``warmup_steps`` (``lr * (k + 1) / warmup_steps``
    at step ``k``), then cosine from ``lr`` to ``eta_min`` over the remaining
    ``total_steps - warmup_steps``: at step ``k >= warmup_steps``,
    ``eta_min + (lr - eta_min) * (1 + cos(pi * (k - warmup_steps) /
    (total_steps - warmup_steps))) / 2``.

    Differs from Colossal-AI's only when ``warmup_steps == total_steps``,
    and only past the schedule: from step ``total_steps`` on the learning
    rate here is ``eta_min``; theirs is ``lr`` at that step and divides by
    zero at the next.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps, warmup_steps)
        # Set before torch's __init__, whose first step reads them.
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        anneal = self.total_steps - self.warmup_steps
        if anneal == 0:
            return self.eta_min
        cosine = (1 + math.cos(math.pi * (step - self.warmup_steps) / anneal)) / 2
        return self.eta_min + (base_lr - self.eta_min) * cosine


class LinearWarmupLR(_ClosedFormLR):
    """Linear warmup to ``lr`` then linear decay to 0 at ``total_steps``: at
    step ``k``, ``lr * (k + 1) / (warmup_steps + 1)`` while ``k <
    warmup_steps``, then ``lr * (total_steps - k) / (total_steps -
    warmup_steps)``.

    Differs from Colossal-AI's past ``total_steps``: theirs goes negative
    (the optimizer would climb the loss) or, with ``warmup_steps ==
    total_steps``, divides by zero; here it stays 0. ``warmup_steps`` above
    ``total_steps`` is taken, as theirs takes it (a run shorter than its
    warmup only warms up).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        if warmup_steps < 0:
            raise ValueError(
                f"LinearWarmupLR: expected warmup_steps >= 0, got warmup_steps={warmup_steps}."
            )
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / (self.warmup_steps + 1)
        if step >= self.total_steps:
            return 0.0
        return base_lr * (self.total_steps - step) / (self.total_steps - self.warmup_steps)


def _polynomial(base_lr: LR, end_lr: float, power: float, step: int, steps: int) -> LR:
    """``end_lr + (base_lr - end_lr) * (1 - step / steps) ** power``, held at
    ``end_lr`` from ``steps`` on."""
    if steps == 0:
        return end_lr
    remaining: float = (1 - min(step, steps) / steps) ** power
    return (base_lr - end_lr) * remaining + end_lr


class PolynomialLR(_ClosedFormLR):
    """Polynomial decay from ``lr`` to ``end_lr`` over ``total_steps``, then
    ``end_lr``: at step ``k``, ``end_lr + (lr - end_lr) * (1 - min(k,
    total_steps) / total_steps) ** power``. Colossal-AI's, not torch's
    ``PolynomialLR`` (whose arguments differ)."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        _check_steps(name, total_steps)
        if end_lr < 0:
            raise ValueError(f"{name}: expected end_lr >= 0, got {end_lr}.")
        self.total_steps = total_steps
        self.end_lr = end_lr
        self.power = power
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        return _polynomial(base_lr, self.end_lr, self.power, step, self.total_steps)


class PolynomialWarmupLR(_ClosedFormLR):
    """Linear warmup over ``warmup_steps`` (``lr * (k + 1) / warmup_steps``),
    then :class:`PolynomialLR`'s decay over the remaining ``total_steps -
    warmup_steps``, counted from the end of the warmup.

    Differs from Colossal-AI's only when ``warmup_steps == total_steps``:
    theirs divides by zero after the warmup; here it is ``end_lr``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        _check_steps(name, total_steps, warmup_steps)
        if end_lr < 0:
            raise ValueError(f"{name}: expected end_lr >= 0, got {end_lr}.")
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.end_lr = end_lr
        self.power = power
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        anneal = self.total_steps - self.warmup_steps
        return _polynomial(base_lr, self.end_lr, self.power, step - self.warmup_steps, anneal)


class MultiStepLR(_TorchMultiStepLR):
    """torch's ``MultiStepLR``: ``lr`` times ``gamma`` once per milestone
    reached. ``total_steps`` is taken for Colossal-AI's call shape; the
    schedule does not depend on it. No milestones (their default) means a
    constant learning rate, as theirs."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, list(milestones or ()), gamma=gamma, last_epoch=last_epoch)


class OneCycleLR(_TorchOneCycleLR):
    """torch's ``OneCycleLR`` over ``total_steps``, peaking at each group's
    ``lr`` as it is when the scheduler is made (Colossal-AI's ``max_lr``):
    it starts at ``lr / div_factor`` and ends at ``lr / div_factor /
    final_div_factor``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        *,
        three_phase: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(
            optimizer,
            [float(group["lr"]) for group in optimizer.param_groups],
            total_steps=total_steps,
            pct_start=float(pct_start),
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
            last_epoch=last_epoch,
        )


class FlatAnnealingLR(_ClosedFormLR):
    """``lr`` for the first ``int(total_steps * pct_start)`` steps (flat),
    then cosine from ``lr`` to 0 over the rest: at step ``k >= flat``,
    ``lr * (1 + cos(pi * (k - flat) / (total_steps - flat))) / 2``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        pct_start: float = 0.72,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        _check_fraction(type(self).__name__, pct_start)
        # Set before torch's __init__, whose first step reads them.
        self.flat_steps = int(total_steps * pct_start)
        self.anneal_steps = total_steps - self.flat_steps
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        return _flat_then_cosine(base_lr, step, self.flat_steps, self.anneal_steps, 0.0)


class FlatAnnealingWarmupLR(_ClosedFormLR):
    """Linear warmup over ``warmup_steps`` (``lr * (k + 1) / warmup_steps``),
    then :class:`FlatAnnealingLR`'s flat part and cosine (down to
    ``eta_min``) over the remaining ``total_steps - warmup_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps, warmup_steps)
        _check_fraction(type(self).__name__, pct_start)
        self.warmup_steps = warmup_steps
        self.flat_steps = int((total_steps - warmup_steps) * pct_start)
        self.anneal_steps = total_steps - warmup_steps - self.flat_steps
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        return _flat_then_cosine(
            base_lr, step - self.warmup_steps, self.flat_steps, self.anneal_steps, self.eta_min
        )


class MultiStepWarmupLR(_ClosedFormLR):
    """Linear warmup over ``warmup_steps``, then ``lr`` times ``gamma`` once
    per milestone reached (milestones count steps from the start, as
    Colossal-AI's; those inside the warmup are dropped, as theirs)."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(type(self).__name__, total_steps, warmup_steps)
        if not milestones:
            raise ValueError(
                "MultiStepWarmupLR: milestones must name at least one step (Colossal-AI refuses "
                "an empty list too); use LinearWarmupLR for a warmup alone."
            )
        self.warmup_steps = warmup_steps
        self.milestones = sorted(m for m in milestones if m >= warmup_steps)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, base_lr: LR, step: int) -> LR:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        passed = sum(1 for m in self.milestones if m <= step)
        return base_lr * self.gamma**passed


def _flat_then_cosine(base_lr: LR, step: int, flat: int, anneal: int, eta_min: float) -> LR:
    if step < flat:
        return base_lr
    if anneal <= 0:
        return eta_min
    cosine = (1 + math.cos(math.pi * min(step - flat, anneal) / anneal)) / 2
    return eta_min + (base_lr - eta_min) * cosine


def _check_fraction(name: str, pct_start: float) -> None:
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"{name}: pct_start must be in [0, 1], got {pct_start}.")


class StepLR(_TorchStepLR):
    """torch's ``StepLR`` (``lr`` times ``gamma`` every ``step_size`` steps);
    ``total_steps`` is taken for Colossal-AI's call shape."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        step_size: int = 1,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(_TorchExponentialLR):
    """torch's ``ExponentialLR`` (``lr`` times ``gamma`` every step);
    ``total_steps`` is taken for Colossal-AI's call shape."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, gamma: float = 1.0, last_epoch: int = -1
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, gamma, last_epoch=last_epoch)


class LambdaLR(_TorchLambdaLR):
    """torch's ``LambdaLR``; ``total_steps`` is taken for Colossal-AI's call
    shape. ``lr_lambda`` is required in practice (as in theirs)."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, lr_lambda: Any = None, last_epoch: int = -1
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, _required_lambda("LambdaLR", lr_lambda), last_epoch)


class MultiplicativeLR(_TorchMultiplicativeLR):
    """torch's ``MultiplicativeLR``; ``total_steps`` is taken for
    Colossal-AI's call shape."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, lr_lambda: Any = None, last_epoch: int = -1
    ) -> None:
        _check_steps(type(self).__name__, total_steps)
        super().__init__(optimizer, _required_lambda("MultiplicativeLR", lr_lambda), last_epoch)


def _required_lambda(name: str, lr_lambda: Any) -> Any:
    if lr_lambda is None:
        raise ValueError(
            f"{name}: lr_lambda is required (a function of the step, or one per param group); "
            "Colossal-AI's default None fails inside torch too."
        )
    return lr_lambda


_IGNORED = "Colossal-AI's schedulers accept and ignore extra keywords; so do these"
for _schedule in (
    CosineAnnealingLR, CosineAnnealingWarmupLR, LinearWarmupLR, MultiStepLR, OneCycleLR,
    PolynomialLR, PolynomialWarmupLR, FlatAnnealingLR, FlatAnnealingWarmupLR, MultiStepWarmupLR,
):  # fmt: skip
    setattr(_schedule, "NO_EFFECT", {"kwargs": _IGNORED})  # noqa: B010
