"""How :class:`~pc_zero.GeminiDDP` sizes its chunks: the chunk-size
settings it takes and the search for the size with the least padding.

[Note: chunk search]
Without ``chunk_size`` the size is searched ([Note: packing] in
pc_chunk.search) from ``min_chunk_size`` (raised to the largest parameter,
lowered to the whole model, so a model smaller than it is one chunk) up by
``search_range``, over multiples of ``hidden_dim`` (the search step;
rounded to a multiple of the world size so a chunk shards evenly) or,
without it, of 64 x the world size. ``search_range_mb`` and
``min_chunk_size_mb`` count units of 2**20 *elements* (their search counts
elements, whatever the suffix says); pc's ``search_range`` and
``min_chunk_size`` count elements; pass one spelling of each. Unlike
the edge's default search, large parameters are not left out here
(the compatibility edge's ``init_chunk_manager`` does leave them out).
``chunk_per_tensor=True`` gives every parameter its own chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pc_chunk import search_chunk_size

__all__ = ["ChunkOptions", "searched_chunk_size"]

# Chunk search sizes in "_mb" / "_m" count 2**20 elements.
_MEGA = 1024 * 1024


def _elements_from_mega(name: str, value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (units of 2**20 elements), got {value!r}.")
    return round(value * _MEGA)


def _one_of(
    pc_name: str, pc_value: int | None, mb_name: str, mb_value: float | None, default: int
) -> int:
    """A search setting given in elements (pc) or in 2**20 elements
    (``_mb``), not both."""
    if pc_value is not None and mb_value is not None:
        raise ValueError(
            f"GeminiDDP: pass {pc_name} (elements) or {mb_name} (2**20 elements), not both."
        )
    if mb_value is not None:
        return _elements_from_mega(mb_name, mb_value)
    return pc_value if pc_value is not None else default


def searched_chunk_size(
    sizes: list[int],
    world: int,
    search_range: int,
    min_chunk_size: int,
    hidden_dim: int | None = None,
) -> int:
    """The chunk size GeminiDDP searches for [Note: chunk search], for
    parameters of ``sizes`` elements in packing order."""
    total = sum(sizes)
    if hidden_dim is not None:
        if isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1:
            raise ValueError(f"hidden_dim must be a positive int or None, got {hidden_dim!r}.")
        quantum = math.lcm(hidden_dim, world)
    else:
        quantum = 64 * world
    # From min_chunk_size (never below the largest parameter, never above
    # the whole model) up by search_range.
    low = max(max(sizes), min(min_chunk_size, total))
    low = -(-low // quantum) * quantum
    return search_chunk_size(sizes, search_range, low, quantum).chunk_size


@dataclass(frozen=True)
class ChunkOptions:
    """GeminiDDP's chunk settings, checked (``chunk_size``, when given, is
    a positive int already), with the search settings in elements [Note:
    chunk search]."""

    chunk_size: int | None
    chunk_per_tensor: bool
    search_range: int
    min_chunk_size: int
    hidden_dim: int | None

    @classmethod
    def checked(
        cls,
        chunk_size: int | None,
        chunk_per_tensor: bool,
        search_range: int | None,
        min_chunk_size: int | None,
        search_range_mb: float | None,
        min_chunk_size_mb: float | None,
        hidden_dim: int | None,
    ) -> ChunkOptions:
        if chunk_per_tensor and chunk_size is not None:
            raise ValueError(
                f"GeminiDDP: chunk_per_tensor=True gives every parameter a chunk of its own; "
                f"chunk_size={chunk_size} asks for one size. Pass one of them."
            )
        search = _one_of("search_range", search_range, "search_range_mb",
                         search_range_mb, 32 * _MEGA)  # fmt: skip
        least = _one_of("min_chunk_size", min_chunk_size, "min_chunk_size_mb",
                        min_chunk_size_mb, 32 * _MEGA)  # fmt: skip
        if hidden_dim is not None and (chunk_size is not None or chunk_per_tensor):
            raise ValueError(
                f"GeminiDDP: hidden_dim={hidden_dim} is the step of the chunk-size search, "
                "and the chunk size is given; drop one of them."
            )
        return cls(chunk_size, chunk_per_tensor, search, least, hidden_dim)

    def size_for(self, sizes: list[int], world: int) -> int | None:
        """The chunk size for parameters of ``sizes`` elements in packing
        order: the given one (checked against the model) or the searched
        one; None with ``chunk_per_tensor``."""
        total = sum(sizes)
        if self.chunk_size is not None and self.chunk_size > 2 * max(total, 1024):
            raise ValueError(
                f"chunk_size {self.chunk_size} is more than twice the whole model ({total} "
                f"trainable elements): one chunk would be mostly padding. Use chunk_size <= "
                f"{total} (rounded up as you need), or None to search for the size with the "
                "least padding."
            )
        if self.chunk_size is None and not self.chunk_per_tensor:
            return searched_chunk_size(sizes, world, self.search_range, self.min_chunk_size,
                                       self.hidden_dim)  # fmt: skip
        return self.chunk_size
