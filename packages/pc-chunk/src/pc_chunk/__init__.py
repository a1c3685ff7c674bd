"""Gemini-style chunk memory manager.

Status: skeleton. Nothing is exported yet; issue 5: `Chunk`, `ChunkManager`,
`search_chunk_size`, `MemoryTracer` and placement policies land here.
"""

__all__: list[str] = []
