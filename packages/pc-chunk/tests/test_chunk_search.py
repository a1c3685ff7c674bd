"""search_chunk_size finds the least padding, checked against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_chunk import packing_waste, search_chunk_size

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    min_chunk=st.integers(1, 400),
    search_range=st.integers(0, 600),
    granularity=st.integers(1, 16),
)
def test_matches_brute_force(
    sizes: list[int], min_chunk: int, search_range: int, granularity: int
) -> None:
    candidates = [
        c
        for c in range(min_chunk, min_chunk + search_range + 1)
        if c % granularity == 0 and c >= max(sizes)
    ]
    if not candidates:
        with pytest.raises(ValueError, match="raise search_range"):
            search_chunk_size(sizes, search_range, min_chunk, granularity)
        return
    best = min(candidates, key=lambda c: (packing_waste(sizes, c)[1], c))
    result = search_chunk_size(sizes, search_range, min_chunk, granularity)
    assert result.chunk_size == best
    assert (result.num_chunks, result.waste) == packing_waste(sizes, best)
    assert result.total == sum(sizes)


def test_thousands_of_parameters() -> None:
    # Its speed is measured in benchmarks/bench_chunk.py, not here.
    import random

    rng = random.Random(0)
    sizes = [rng.choice([768 * 768, 768 * 3072, 768, 3072, 50257 * 768]) for _ in range(3000)]
    result = search_chunk_size(sizes, 64 * 1024 * 1024, 40 * 1024 * 1024, 1024)
    assert result.chunk_size >= max(sizes)
    assert result.waste == packing_waste(sizes, result.chunk_size)[1]


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        search_chunk_size([], 10, 10)
    with pytest.raises(ValueError, match="largest parameter"):
        search_chunk_size([5000], 100, 1000, 10)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=30),
    n_grids=st.integers(1, 8),
    step=st.integers(0, 40),
)
def test_grid_search_matches_brute_force(sizes: list[int], n_grids: int, step: int) -> None:
    """Colossal-AI's grid: n_grids + 1 sizes from the largest parameter."""
    from pc_chunk import grid_search_chunk_size

    start = max(sizes)
    grid = [start + i * step for i in range(n_grids + 1)]
    best = min(grid, key=lambda c: (packing_waste(sizes, c)[1], c))
    assert grid_search_chunk_size(sizes, step * n_grids, n_grids, None, False) == best


def test_grid_search_leaves_out_very_large_parameters() -> None:
    from pc_chunk import filter_exlarge_sizes, grid_search_chunk_size

    sizes = [16, 4] * 10 + [10000]
    assert filter_exlarge_sizes(sizes) == [16, 4] * 10
    assert grid_search_chunk_size(sizes, 64, 4) == 48
    assert grid_search_chunk_size(sizes, 64, 4, filter_exlarge_params=False) == 10000
    with pytest.raises(ValueError, match="multiple of n_grids"):
        grid_search_chunk_size(sizes, 10, 4)
