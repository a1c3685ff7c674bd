"""``colossalai.nn.lr_scheduler`` (pc-booster's schedules of the same names)."""

from __future__ import annotations

from pc_booster.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
]
