"""pc-chunk: parameters packed in execution order into equal contiguous
chunks (the Gemini design, docs/packages/pc-chunk.md), sharded across ranks, placed on the
device or the host against an accounted budget, with a chunk-size search and
a memory tracer."""

from pc_chunk.budget import BudgetExceededError, DeviceBudget
from pc_chunk.chunk import Chunk, ChunkState, ChunkStateError
from pc_chunk.lazy import LazyInitContext, is_lazy, materialize, materialize_, materialize_module
from pc_chunk.manager import AutoPlacement, ChunkManager, StaticPlacement, execution_order
from pc_chunk.search import (
    ChunkSizeResult,
    filter_exlarge_sizes,
    grid_search_chunk_size,
    packing_waste,
    search_chunk_size,
)
from pc_chunk.tracer import MemoryTracer, OpRecord, measure_peak

__version__ = "0.1.0"

__all__ = [
    "AutoPlacement",
    "BudgetExceededError",
    "Chunk",
    "ChunkManager",
    "ChunkSizeResult",
    "ChunkState",
    "ChunkStateError",
    "DeviceBudget",
    "LazyInitContext",
    "MemoryTracer",
    "OpRecord",
    "StaticPlacement",
    "execution_order",
    "filter_exlarge_sizes",
    "grid_search_chunk_size",
    "is_lazy",
    "materialize",
    "materialize_",
    "materialize_module",
    "measure_peak",
    "packing_waste",
    "search_chunk_size",
]
