"""``haiscale.pipeline``: the pipeline schedules, ``partition``,
``SequentialModel`` and ``make_subgroups`` (pc-pipeline's)."""

from __future__ import annotations

from pc_pipeline import (
    GPipe,
    Interleaved1F1B,
    PipeDream,
    SequentialModel,
    ZeroBubble,
    make_subgroups,
    partition,
)

__all__ = [
    "GPipe",
    "Interleaved1F1B",
    "PipeDream",
    "SequentialModel",
    "ZeroBubble",
    "make_subgroups",
    "partition",
]
