"""``colossalai.zero.gemini``'s chunk objects: ``search_chunk_configuration``
(Colossal-AI's search on pc-chunk's packing), the modern ``ChunkManager``
(a chunk configuration dict) and ``GeminiManager`` (placement keywords).

[Note: chunk configurations]
Colossal-AI describes chunks as ``{dp_degree: {"chunk_size": n,
"keep_gathered": bool}}``: one entry per data-parallel degree, keyed by the
size of the group the chunks are sharded over. pc shards every chunk over
one group, so a configuration has one entry and its key must be that
group's size. ``keep_gathered=True`` (what the search gives a model smaller
than ``min_chunk_size_m``: one chunk kept whole on every rank) is accepted
and the chunk is sharded all the same, as
the older tutorial's ``init_chunk_manager`` (``pc_compat.colossalai.legacy.zero``)
does for that case: the values
computed are the same, at 1/N of the memory. The chunk size is rounded up to
a multiple of the group size, so every rank owns an equal shard.

The modern ``ChunkManager`` is the older tutorial's
``ChunkManager`` (``pc_compat.colossalai.legacy.zero``; settings that
``ZeroDDP`` builds chunks from) made from a
configuration: ``ZeroDDP(model, GeminiManager(policy, ChunkManager(config)))``
trains as the tutorial shape does. ``GeminiDDP`` builds its own, as
Colossal-AI's does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from pc_chunk import filter_exlarge_sizes, search_chunk_size
from pc_compat.colossalai.legacy.zero import _tutorial as _colossal
from pc_compat.colossalai.zero._edges import (
    EdgeTranslation,
    TranslatedEdge,
    install,
    refuse_unless,
    taken_by_edge,
    world_size,
)

__all__ = [
    "RATIOS",
    "SHARD_PARAM_FRAC",
    "ChunkManager",
    "GeminiManager",
    "chunk_size_of",
    "host_fraction",
    "search_chunk_configuration",
]

_MODULE = "colossalai.zero.gemini"
_MEGA = 1024 * 1024

# Why placement arguments pc cannot give are refused (GeminiDDP and GeminiManager).
SHARD_PARAM_FRAC = (
    "pc's Gemini shards every chunk over the ranks (1.0); for whole parameters on every rank "
    "use LowLevelZeroOptimizer (ZeRO-1/2)."
)
RATIOS = (
    "pc's 'auto' placement keeps chunks on the device within GeminiDDP(device_budget_bytes=) "
    "(by default the device's free memory), not by these ratios; give the budget and leave "
    "the ratio at its default."
)
# What GeminiManager's **placement_kwargs take: Colossal-AI's and pc's budget.
_PLACEMENT_KEYWORDS = (
    "offload_param_frac",
    "offload_optim_frac",
    "shard_param_frac",
    "max_prefetch",
    "warmup_non_model_data_ratio",
    "steady_cuda_cap_ratio",
    "device_budget_bytes",
)
_PREFETCH = (
    "how many chunks the original fetches ahead; pc gathers ahead as its own prefetch= says, "
    "and the values computed are the same"
)


def search_chunk_configuration(
    model: nn.Module,
    search_range_m: float,
    search_interval: int,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    strict_ddp_flag: bool = False,
    process_group: dist.ProcessGroup | None = None,
    memstas: Any = None,
) -> tuple[dict[int, dict[str, Any]], int, int]:
    """Colossal-AI's chunk search over ``model``'s trainable parameters in
    module order: ``(configuration, elements, padding)`` [Note: chunk
    configurations]. Sizes count 2**20 elements (``_m``); the sizes tried
    are multiples of ``search_interval`` from the larger of the minimum and
    the largest parameter searched, up by ``search_range_m``; the least
    padding wins (pc_chunk.search_chunk_size), then it is rounded up to a
    multiple of the group size. A model smaller than the minimum is one
    chunk (``keep_gathered``, padding 0). With ``filter_exlarge_params``
    parameters above mean + 3 std of the sizes are left out of the search
    (they get chunks of their own)."""
    if memstas is not None:
        raise ValueError(
            "search_chunk_configuration(memstas=...): pc has no Colossal-AI MemStats; pc orders "
            "parameters by the module here, and GeminiDDP(example_inputs=...) packs them in "
            "execution order. Leave memstas out."
        )
    if isinstance(search_interval, bool) or not isinstance(search_interval, int):
        raise TypeError(f"search_interval must be an int (elements), got {search_interval!r}.")
    if search_interval < 1:
        raise ValueError(f"search_interval must be >= 1, got {search_interval}.")
    search_range = _elements("search_range_m", search_range_m)
    min_chunk_size = _elements("min_chunk_size_m", min_chunk_size_m)
    world = world_size("search_chunk_configuration", process_group)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if not sizes:
        raise ValueError("search_chunk_configuration: the model has no trainable parameters.")
    total = sum(sizes)
    if total < min_chunk_size:
        return {world: {"chunk_size": total, "keep_gathered": True}}, total, 0
    searched = filter_exlarge_sizes(sizes) if filter_exlarge_params else sizes
    start = math.ceil(max(min_chunk_size, max(searched)) / search_interval) * search_interval
    best = search_chunk_size(searched, search_range, start, search_interval)
    chunk_size = best.chunk_size + (-best.chunk_size % world)
    return {world: {"chunk_size": chunk_size, "keep_gathered": False}}, total, best.waste


setattr(  # noqa: B010
    search_chunk_configuration,
    "NO_EFFECT",
    {"strict_ddp_flag": "the original's search does not read it either (the sizes are the same)"},
)


def _elements(name: str, value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (units of 2**20 elements), got {value!r}.")
    return round(value * _MEGA)


def chunk_size_of(owner: str, configuration: Any, world: int) -> int:
    """The chunk size a configuration asks for [Note: chunk configurations],
    rounded up to a multiple of ``world``."""
    if not isinstance(configuration, Mapping) or len(configuration) != 1:
        raise ValueError(
            f"{owner}: a chunk configuration is {{dp_degree: {{'chunk_size': n, "
            f"'keep_gathered': bool}}}} with one entry (pc shards every chunk over one group), "
            f"got {configuration!r}. Use search_chunk_configuration(model, ...)[0]."
        )
    ((degree, entry),) = configuration.items()
    if degree != world:
        raise ValueError(
            f"{owner}: the chunk configuration is for a group of {degree} ranks, but the chunks "
            f"are sharded over {world}; key it by the group's size (search_chunk_configuration "
            "with the same process_group does)."
        )
    if not isinstance(entry, Mapping):
        entry = {"chunk_size": entry}  # reported below as it arrived
    unknown = sorted(set(entry) - {"chunk_size", "keep_gathered"})
    size = entry.get("chunk_size")
    if unknown or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"{owner}: a chunk configuration entry holds 'chunk_size' (a positive int) and "
            f"optionally 'keep_gathered'; got {entry!r}."
        )
    return size + (-size % world)


def host_fraction(owner: str, offload_param_frac: float, offload_optim_frac: float) -> float:
    """The share of chunks on the host: pc keeps a chunk's optimizer states
    with its shard, so ``offload_optim_frac`` moves the shards too (the
    values computed are the same); two different shares are refused."""
    for name, value in (("offload_optim_frac", offload_optim_frac),
                        ("offload_param_frac", offload_param_frac)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"{owner}({name}={value!r}): a share of the chunks, in [0, 1].")
    if offload_optim_frac and offload_param_frac and offload_optim_frac != offload_param_frac:
        raise ValueError(
            f"{owner}(offload_optim_frac={offload_optim_frac}, offload_param_frac="
            f"{offload_param_frac}): pc keeps a chunk's optimizer states with its shard, so one "
            "share of the chunks goes to the host; give one fraction."
        )
    return float(offload_param_frac or offload_optim_frac)


class ChunkManager(TranslatedEdge, _colossal.ChunkManager):
    """Colossal-AI's ``ChunkManager(chunk_configuration, init_device=None,
    ...)`` [Note: chunk configurations]; pc's ``process_group`` (the group
    the chunks are sharded over, default every rank) is a keyword after
    the original's arguments."""

    CORE = _colossal.ChunkManager
    TRANSLATION = EdgeTranslation(
        _MODULE,
        "ChunkManager",
        no_effect={
            "reuse_fp16_chunk": (
                "whether the original writes gradients into the fp16 chunk's memory; pc keeps "
                "gradient shards apart, and the values computed are the same"
            ),
            "max_prefetch": _PREFETCH,
        },
        handled={
            "chunk_configuration": taken_by_edge,
            "fp8_communication": refuse_unless(
                "ChunkManager",
                "fp8_communication",
                False,
                "pc gathers and reduces chunks in their own dtype (no fp8 path); leave it False.",
            ),
        },
        fills=frozenset({"chunk_size", "enable_distributed_storage"}),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = self.TRANSLATION.arguments(self.CORE, args, kwargs)
        pc = self.TRANSLATION.to_pc(self.CORE, args, kwargs)
        world = world_size("ChunkManager", pc["process_group"])
        pc["chunk_size"] = chunk_size_of("ChunkManager", values["chunk_configuration"], world)
        pc["enable_distributed_storage"] = True
        super().__init__(**pc)


class GeminiManager(TranslatedEdge, _colossal.GeminiManager):
    """Colossal-AI's ``GeminiManager(placement_policy, chunk_manager,
    memstats=None, **placement_kwargs)`` over the older tutorial's (settings
    ``ZeroDDP`` reads). ``placement_kwargs``: Colossal-AI's placement
    arguments (``offload_param_frac``, ``offload_optim_frac``,
    ``shard_param_frac``, ``max_prefetch``, the 'auto' ratios) and pc's
    ``device_budget_bytes``."""

    CORE = _colossal.GeminiManager
    TRANSLATION = EdgeTranslation(
        _MODULE, "GeminiManager", handled={"placement_kwargs": taken_by_edge}
    )

    def __init__(
        self,
        placement_policy: str,
        chunk_manager: _colossal.ChunkManager,
        memstats: Any = None,
        **placement_kwargs: Any,
    ) -> None:
        options = dict(placement_kwargs)
        known = set(_PLACEMENT_KEYWORDS)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"GeminiManager: unexpected placement argument(s) {unknown}; pc takes "
                f"{sorted(known)}."
            )
        refuse_unless("GeminiManager", "shard_param_frac", 1.0, SHARD_PARAM_FRAC)(
            options.get("shard_param_frac", 1.0)
        )
        for name, default in (("warmup_non_model_data_ratio", 0.8), ("steady_cuda_cap_ratio", 0.9)):
            refuse_unless("GeminiManager", name, default, RATIOS)(options.get(name, default))
        fraction = host_fraction(
            "GeminiManager",
            options.get("offload_param_frac", 0.0),
            options.get("offload_optim_frac", 0.0),
        )
        super().__init__(
            placement_policy,
            chunk_manager,
            memstats,
            offload_param_frac=fraction,
            device_budget_bytes=options.get("device_budget_bytes"),
        )


install(ChunkManager)
