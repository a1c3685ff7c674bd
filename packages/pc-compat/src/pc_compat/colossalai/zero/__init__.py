"""``colossalai.zero``: Gemini (chunk-based ZeRO-3) and low-level ZeRO-1/2
over pc-zero, with Colossal-AI's signatures and defaults [Note: edges from
signatures in pc_compat.surface], and the stage wrappers."""

from __future__ import annotations

from pc_compat.colossalai.legacy.zero.gemini import ColoInitContext
from pc_compat.colossalai.zero._gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer
from pc_compat.colossalai.zero._low_level import LowLevelZeroOptimizer
from pc_compat.colossalai.zero._wrapper import zero_model_wrapper, zero_optim_wrapper

__all__ = [
    "ColoInitContext",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "LowLevelZeroOptimizer",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
