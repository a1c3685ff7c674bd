"""``colossalai.zero``: Gemini and low-level ZeRO (pc-zero's)."""

from __future__ import annotations

from pc_zero import (
    ColoInitContext,
    GeminiAdamOptimizer,
    GeminiDDP,
    GeminiOptimizer,
    LowLevelZeroOptimizer,
)

__all__ = [
    "ColoInitContext",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "LowLevelZeroOptimizer",
]
