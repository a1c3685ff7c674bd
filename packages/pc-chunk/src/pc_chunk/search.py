"""Chunk-size search: the size that wastes the least memory on padding.

[Note: packing]
Parameters are packed in a fixed order (execution order) into chunks of one
size C: a parameter goes into the current chunk if it fits, otherwise it
opens the next chunk. The waste of C is ``chunks(C) * C - total``. C must
hold the largest parameter, so candidates below it are skipped. The search
tries every C in ``[min_chunk_size, min_chunk_size + search_range]`` that is
a multiple of ``granularity`` and returns the one with the least waste (the
smallest such C on ties).

The greedy packing is sequential over parameters but independent across
candidates, so it runs once over the parameters with one vector of fills
and counts per candidate: thousands of parameters times tens of thousands of
candidates take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["ChunkSizeResult", "packing_waste", "search_chunk_size"]


@dataclass(frozen=True)
class ChunkSizeResult:
    chunk_size: int
    num_chunks: int
    waste: int  # padding elements over all chunks
    total: int  # elements of all parameters

    @property
    def waste_ratio(self) -> float:
        return self.waste / max(1, self.num_chunks * self.chunk_size)


def _sizes(params: Iterable[torch.Tensor | int]) -> list[int]:
    return [p if isinstance(p, int) else p.numel() for p in params]


def packing_waste(sizes: Iterable[int], chunk_size: int) -> tuple[int, int]:
    """(chunks, waste) of packing ``sizes`` in order into ``chunk_size``
    chunks [Note: packing]: the reference the search is tested against."""
    chunks, fill, total = 0, chunk_size, 0
    for size in sizes:
        if size > chunk_size:
            raise ValueError(f"a parameter of {size} elements does not fit a {chunk_size} chunk.")
        total += size
        if fill + size > chunk_size:
            chunks, fill = chunks + 1, 0
        fill += size
    return chunks, chunks * chunk_size - total


def search_chunk_size(
    params: Iterable[torch.Tensor | int],
    search_range: int,
    min_chunk_size: int,
    granularity: int = 1024,
) -> ChunkSizeResult:
    """The chunk size with the least padding [Note: packing]. ``params`` are
    tensors or element counts, in packing order."""
    sizes = _sizes(params)
    if not sizes:
        raise ValueError("search_chunk_size needs at least one parameter.")
    for name, value in (("granularity", granularity), ("min_chunk_size", min_chunk_size),
                        ("search_range", search_range)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (elements), got {value!r}.")
    if granularity < 1 or min_chunk_size < 1 or search_range < 0:
        raise ValueError(
            "granularity and min_chunk_size must be >= 1 and search_range >= 0; got "
            f"{granularity}, {min_chunk_size}, {search_range}."
        )
    largest = max(sizes)
    low = max(min_chunk_size, largest)
    low = -(-low // granularity) * granularity
    high = min_chunk_size + search_range
    if low > high:
        raise ValueError(
            f"no chunk size in [{min_chunk_size}, {high}] (multiples of {granularity}) holds "
            f"the largest parameter ({largest} elements); raise search_range to at least "
            f"{low - min_chunk_size}."
        )
    # A size that holds everything in one chunk wastes more the larger it
    # is, so nothing above the total (rounded up) can win.
    total = sum(sizes)
    high = min(high, max(low, -(-total // granularity) * granularity))
    candidates = torch.arange(low, high + 1, granularity, dtype=torch.int64)
    fill = candidates.clone()  # a full "previous chunk" forces the first one open
    chunks = torch.zeros_like(candidates)
    for size in sizes:
        opens = fill + size > candidates
        chunks += opens
        fill = torch.where(opens, size, fill + size)
    waste = chunks * candidates - total
    best = int(torch.argmin(waste))  # argmin returns the first minimum: the smallest size
    return ChunkSizeResult(
        chunk_size=int(candidates[best]),
        num_chunks=int(chunks[best]),
        waste=int(waste[best]),
        total=total,
    )
