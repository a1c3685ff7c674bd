"""``colossalai.zero.gemini``."""

from __future__ import annotations

from pc_zero import GeminiDDP, GeminiManager, GeminiOptimizer
from pc_zero.colossal import ChunkManager

__all__ = ["ChunkManager", "GeminiDDP", "GeminiManager", "GeminiOptimizer"]
