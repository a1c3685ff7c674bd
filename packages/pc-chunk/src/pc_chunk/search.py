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

[Note: grid search]
The Gemini grid search (``search_chunk_size(module, search_range, n_grids,
min_chunk_size=None, filter_exlarge_params=True)`` at the compatibility
edge, docs/packages/pc-compat.md) tries
``n_grids + 1`` sizes, ``start, start + step, ... start + search_range``
with ``step = search_range // n_grids`` and ``start`` the minimum chunk size
(default: the largest parameter), and keeps the one with the best
utilisation (the least waste, the first on ties). With
``filter_exlarge_params`` parameters above ``mean + 3 * std`` of the sizes
(population standard deviation) are left out of the search: they are
packed into chunks of their own (pc_chunk.manager, [Note: oversized
parameters]). :func:`grid_search_chunk_size` is that search, on the same
vectorised packing as :func:`search_chunk_size`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "ChunkSizeResult",
    "filter_exlarge_sizes",
    "grid_search_chunk_size",
    "packing_waste",
    "search_chunk_size",
]


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
    return _least_waste(sizes, candidates)


def _least_waste(sizes: list[int], candidates: torch.Tensor) -> ChunkSizeResult:
    """The candidate with the least padding, the first on ties [Note: packing]."""
    total = sum(sizes)
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


def filter_exlarge_sizes(sizes: Iterable[int]) -> list[int]:
    """``sizes`` without those above ``mean + 3 * std`` (population standard
    deviation) [Note: grid search]."""
    kept = list(sizes)
    if not kept:
        return kept
    values = torch.tensor(kept, dtype=torch.float64)
    limit = float(values.mean() + 3 * values.std(unbiased=False))
    return [size for size in kept if size <= limit]


def grid_search_chunk_size(
    params: Iterable[torch.Tensor | int],
    search_range: int,
    n_grids: int,
    min_chunk_size: int | None = None,
    filter_exlarge_params: bool = True,
) -> int:
    """The grid search [Note: grid search]: the
    chunk size (elements) with the least padding among ``n_grids + 1``
    evenly spaced sizes from ``min_chunk_size`` (default: the largest
    parameter) up by ``search_range``."""
    for name, value in (("search_range", search_range), ("n_grids", n_grids)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
    if search_range < 0 or n_grids < 1:
        raise ValueError(
            f"search_range must be >= 0 and n_grids >= 1; got {search_range} and {n_grids}."
        )
    if search_range % n_grids:
        raise ValueError(
            f"search_range ({search_range}) must be a multiple of n_grids ({n_grids}): the "
            "search tries evenly spaced sizes search_range // n_grids apart."
        )
    sizes = _sizes(params)
    if filter_exlarge_params:
        sizes = filter_exlarge_sizes(sizes)
    if not sizes:
        raise ValueError("search_chunk_size needs at least one parameter.")
    largest = max(sizes)
    if min_chunk_size is None:
        min_chunk_size = largest
    elif min_chunk_size < largest:
        raise ValueError(
            f"min_chunk_size ({min_chunk_size}) is smaller than the largest parameter the "
            f"search packs ({largest} elements); pass min_chunk_size >= {largest} or None."
        )
    step = search_range // n_grids
    if step == 0:
        candidates = torch.tensor([min_chunk_size], dtype=torch.int64)
    else:
        high = min_chunk_size + search_range
        candidates = torch.arange(min_chunk_size, high + 1, step, dtype=torch.int64)
    return _least_waste(sizes, candidates).chunk_size
