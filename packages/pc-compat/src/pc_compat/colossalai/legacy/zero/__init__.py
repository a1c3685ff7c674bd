"""``colossalai.legacy.zero``: the names of Colossal-AI's older Gemini
tutorial ("ZeRO with chunk-based memory management"): ``init_chunk_manager``,
the older ``ChunkManager(chunk_size, process_group, enable_distributed_storage,
init_device)``, ``GeminiManager(policy, chunk_manager)``, ``ZeroDDP``,
``ZeroOptimizer`` and ``GeminiAdamOptimizer(model, **defaults)`` over
pc-zero's Gemini ([Note in _tutorial])."""

from __future__ import annotations

from pc_compat.colossalai.legacy.zero._tutorial import (
    ChunkManager,
    GeminiAdamOptimizer,
    GeminiManager,
    ZeroDDP,
    ZeroOptimizer,
    init_chunk_manager,
)

__all__ = [
    "ChunkManager",
    "GeminiAdamOptimizer",
    "GeminiManager",
    "ZeroDDP",
    "ZeroOptimizer",
    "init_chunk_manager",
]
