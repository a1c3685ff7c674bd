"""``colossalai.booster.plugin``: the plugins with Colossal-AI's signatures
and defaults [Note: edges from signatures in pc_compat.surface].

Each plugin here takes exactly the parameters of Colossal-AI's (read from
``signatures/colossalai.json``) with Colossal-AI's defaults, so
``LowLevelZeroPlugin``, ``GeminiPlugin`` and ``HybridParallelPlugin`` train
in fp16 unless told otherwise (pc's own plugins train in the model's dtype),
and ``LowLevelZeroPlugin``'s loss scale starts at 2**32. Each argument is
pc's plugin's (same name), one that has no effect in pc (listed in
``no_effect`` with the reason), or one the edge translates (``handled``).
pc's own options that Colossal-AI lacks are accepted as keywords after
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pc_booster as _core
from pc_booster import ParallelLayout
from pc_booster.plugin import Plugin
from pc_compat.colossalai.booster.plugin._gemini import (
    GEMINI_HANDLED,
    GEMINI_NO_EFFECT,
    gemini_to_pc,
)
from pc_compat.colossalai.booster.plugin._hybrid import (
    HYBRID_HANDLED,
    HYBRID_NO_EFFECT,
    MOE_HANDLED,
    hybrid_to_pc,
    moe_hybrid_to_pc,
)
from pc_compat.colossalai.booster.plugin._low_level import LOW_LEVEL_HANDLED, low_level_to_pc
from pc_compat.colossalai.shardformer import GradientCheckpointConfig
from pc_compat.surface import Translation

__all__ = [
    "DDPPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MoeHybridParallelPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]

DDPPlugin = _core.DDPPlugin  # pc's own (hfreduce-style); Colossal-AI has no such plugin

_MODULE = "colossalai.booster.plugin"
_OVERLAP = (
    "an overlap of the original's own communication; pc overlaps its gathers and "
    "reductions as its schedule allows, and the values computed are the same"
)


def _together(value: Any) -> dict[str, Any]:
    """An argument translated with others, by the translation's ``combine``."""
    return {}


def _no_fp8(value: Any) -> dict[str, Any]:
    if value:
        raise ValueError(
            "fp8_communication=True: pc all-gathers and reduces in the parameters' and "
            "gradients' own dtype; there is no fp8 path. Leave it False."
        )
    return {}


class ProcessGroupMeshView:
    """What programs read of Colossal-AI's ``plugin.pg_mesh``: pc's
    :class:`~pc_booster.ParallelLayout` (its groups and coordinates read
    through) and ``get_ranks_in_group(group)``, the global ranks of a
    group."""

    def __init__(self, layout: ParallelLayout) -> None:
        # The plugin's layout, whose attributes read through.
        self.layout = layout

    def get_ranks_in_group(self, group: Any) -> list[int]:
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(group))

    def __getattr__(self, name: str) -> Any:
        if name == "layout":
            raise AttributeError(name)
        return getattr(self.layout, name)


class DPPluginBase(Plugin):
    """The base of the edge's plugins (Colossal-AI's base of its data-parallel
    plugins has the same name): the translation each declares."""

    TRANSLATION: ClassVar[Translation]
    CORE: ClassVar[type[Plugin]]

    # prepare_dataloader is pc's Plugin's, which takes Colossal-AI's arguments.


def _install(edge: type[DPPluginBase]) -> None:
    """``inspect.signature(edge)`` shows the original's parameters."""
    setattr(edge.__init__, "__signature__", edge.TRANSLATION.signature(edge.CORE))  # noqa: B010


class TorchDDPPlugin(DPPluginBase, _core.TorchDDPPlugin):
    """Colossal-AI's ``TorchDDPPlugin`` (torch's DistributedDataParallel)."""

    CORE = _core.TorchDDPPlugin
    TRANSLATION = Translation(_MODULE, "TorchDDPPlugin", handled={"fp8_communication": _no_fp8})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**self.TRANSLATION.to_pc(self.CORE, args, kwargs))


class TorchFSDPPlugin(DPPluginBase, _core.TorchFSDPPlugin):
    """Colossal-AI's ``TorchFSDPPlugin`` (FSDP1's arguments, run as FSDP2)."""

    CORE = _core.TorchFSDPPlugin
    TRANSLATION = Translation(_MODULE, "TorchFSDPPlugin", handled={"fp8_communication": _no_fp8})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**self.TRANSLATION.to_pc(self.CORE, args, kwargs))


class LowLevelZeroPlugin(DPPluginBase, _core.LowLevelZeroPlugin):
    """Colossal-AI's ``LowLevelZeroPlugin``: ZeRO-1/2, fp16 by default."""

    CORE = _core.LowLevelZeroPlugin
    TRANSLATION = Translation(
        _MODULE,
        "LowLevelZeroPlugin",
        no_effect={"overlap_allgather": _OVERLAP},
        handled=dict.fromkeys(LOW_LEVEL_HANDLED, _together),
        combine=low_level_to_pc,
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**self.TRANSLATION.to_pc(self.CORE, args, kwargs))


class GeminiPlugin(DPPluginBase, _core.GeminiPlugin):
    """Colossal-AI's ``GeminiPlugin``: chunk-based ZeRO-3, fp16 by default."""

    CORE = _core.GeminiPlugin
    TRANSLATION = Translation(
        _MODULE,
        "GeminiPlugin",
        no_effect=GEMINI_NO_EFFECT,
        handled=dict.fromkeys(GEMINI_HANDLED, _together),
        combine=gemini_to_pc,
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**self.TRANSLATION.to_pc(self.CORE, args, kwargs))


def _checkpoint_config(value: Any) -> dict[str, Any]:
    """Checks Colossal-AI's recomputation config; ``hybrid_to_pc`` turns it
    into pc's per-block options: full recomputation of the first
    ``gradient_checkpointing_ratio`` of the blocks (a pipeline config's
    ``num_ckpt_layers_per_stage``: their sum over ``num_model_layers``)."""
    if value is not None and not isinstance(value, GradientCheckpointConfig):
        raise TypeError(
            "gradient_checkpoint_config: expected a GradientCheckpointConfig or "
            "PipelineGradientCheckpointConfig (pc_compat.colossalai.shardformer), got "
            f"{type(value).__name__}."
        )
    return {}


class HybridParallelPlugin(DPPluginBase, _core.HybridParallelPlugin):
    """Colossal-AI's ``HybridParallelPlugin``: tp x pp x sp x dp with ZeRO,
    fp16 by default. ``gradient_checkpoint_config`` is pc's per-block
    recomputation of that share of the blocks (:func:`_checkpoint_config`)."""

    CORE = _core.HybridParallelPlugin
    TRANSLATION = Translation(
        _MODULE,
        "HybridParallelPlugin",
        no_effect={"overlap_p2p": _OVERLAP, "overlap_allgather": _OVERLAP, **HYBRID_NO_EFFECT},
        handled={
            "gradient_checkpoint_config": _checkpoint_config,
            **dict.fromkeys(HYBRID_HANDLED, _together),
        },
        combine=hybrid_to_pc,
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**self.TRANSLATION.to_pc(self.CORE, args, kwargs))

    @property
    def pg_mesh(self) -> ProcessGroupMeshView:
        """Colossal-AI's ``ProcessGroupMesh``: pc's layout of the process
        groups (``dp_group``, ``tp_group``, ``pp_group``, this rank's
        coordinates), with ``get_ranks_in_group``."""
        return ProcessGroupMeshView(self.layout)


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """Colossal-AI's ``MoeHybridParallelPlugin(tp_size, pp_size, ep_size,
    ...)``: pc's HybridParallelPlugin with ``ep_size`` (the experts of each
    MoE block split over ep data-parallel ranks, pc_tensor.shard_experts),
    fp16 by default as the original; ``moe_dp_outside`` is ``dp_outside``'s
    counterpart (True: pc's layout)."""

    TRANSLATION = Translation(
        _MODULE,
        "MoeHybridParallelPlugin",
        no_effect={"overlap_p2p": _OVERLAP, "overlap_allgather": _OVERLAP, **HYBRID_NO_EFFECT},
        handled={
            "gradient_checkpoint_config": _checkpoint_config,
            **dict.fromkeys(MOE_HANDLED, _together),
        },
        combine=moe_hybrid_to_pc,
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # its own, for its own signature
        super().__init__(*args, **kwargs)


_EDGES = (
    TorchDDPPlugin,
    TorchFSDPPlugin,
    LowLevelZeroPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    MoeHybridParallelPlugin,
)
for _edge in _EDGES:
    _install(_edge)

PLUGINS: dict[str, Callable[..., Any]] = {
    "TorchDDPPlugin": TorchDDPPlugin,
    "TorchFSDPPlugin": TorchFSDPPlugin,
    "LowLevelZeroPlugin": LowLevelZeroPlugin,
    "GeminiPlugin": GeminiPlugin,
    "HybridParallelPlugin": HybridParallelPlugin,
    "MoeHybridParallelPlugin": MoeHybridParallelPlugin,
}
