"""``colossalai.zero.gemini``: the Gemini classes, the modern
``ChunkManager`` (from a chunk configuration) and ``GeminiManager``, and
``search_chunk_configuration`` ([Note: chunk configurations] in
pc_compat.colossalai.zero._chunks)."""

from __future__ import annotations

from pc_compat.colossalai.zero._chunks import (
    ChunkManager,
    GeminiManager,
    search_chunk_configuration,
)
from pc_compat.colossalai.zero._gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer

__all__ = [
    "ChunkManager",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiManager",
    "GeminiOptimizer",
    "search_chunk_configuration",
]
