"""``colossalai.zero``'s ``GeminiDDP``, ``GeminiOptimizer`` and
``GeminiAdamOptimizer`` over pc-zero's, with Colossal-AI's parameters and
defaults: ``GeminiDDP`` computes in fp16 unless told otherwise (pc also takes
``mixed_precision=torch.float32``, which Colossal-AI's refuses), computes on
the accelerator's current device, and sizes its chunks by Colossal-AI's
search (``search_chunk_configuration``) unless ``chunk_config_dict`` (or pc's
``chunk_size``) gives the size. ``GeminiOptimizer`` scales the loss for fp16
only, as Colossal-AI's does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pc_compat.colossalai.accelerator import get_accelerator
from pc_compat.colossalai.nn.optimizer import HybridAdam
from pc_compat.colossalai.zero._chunks import (
    RATIOS,
    SHARD_PARAM_FRAC,
    chunk_size_of,
    host_fraction,
    search_chunk_configuration,
)
from pc_compat.colossalai.zero._edges import (
    LOSS_SCALE_FIELDS,
    EdgeTranslation,
    TranslatedEdge,
    install,
    loss_scale_config,
    refuse_unless,
    taken_by_edge,
    world_size,
)
from pc_zero import gemini as _pc

__all__ = ["GeminiAdamOptimizer", "GeminiDDP", "GeminiOptimizer"]

_MODULE = "colossalai.zero"
_SAME_VALUES = "and the values computed are the same"
_NO_FP8 = (
    "pc gathers and reduces chunks in their own dtype and computes without fp8; leave it False."
)
_DATA_PARALLEL = (
    "pc's Gemini is data parallel over one group (zero_group); tensor parallelism and a "
    "second data-parallel level are HybridParallelPlugin's."
)


def _refuse(name: str, default: Any, reason: str) -> Callable[[Any], dict[str, Any]]:
    return refuse_unless("GeminiDDP", name, default, reason)


class GeminiDDP(TranslatedEdge, _pc.GeminiDDP):
    """Colossal-AI's ``GeminiDDP(module, chunk_config_dict=None, ...)``:
    pc-zero's chunk-based ZeRO-3 ([Note: Gemini] in pc_zero.gemini), with
    pc's own options (``device``, ``chunk_size``, ``device_budget_bytes``,
    ``example_inputs``, ``step_in_backward``, ...) as keywords after the
    original's arguments."""

    CORE = _pc.GeminiDDP
    TRANSLATION = EdgeTranslation(
        _MODULE,
        "GeminiDDP",
        no_effect={
            "chunk_init_device": (
                "where the original first builds chunks before its placement moves them; pc "
                f"builds each shard where the placement keeps it, {_SAME_VALUES}"
            ),
            "enable_gradient_accumulation": (
                "pc accumulates gradients over several backwards before a step either way "
                "(the original needs it set to do so)"
            ),
            "max_prefetch": (
                f"how many chunks the original fetches ahead; pc gathers ahead as its own "
                f"prefetch= says, {_SAME_VALUES}"
            ),
            "scatter_after_inference": (
                "whether the original frees gathered chunks after a forward without backward; "
                f"pc releases each chunk after use, {_SAME_VALUES}"
            ),
            "verbose": "the original prints its chunk search; pc prints nothing there",
            "enable_async_reduce": (
                f"pc reduces each chunk's gradients while backward goes on, {_SAME_VALUES}"
            ),
        },
        handled={
            "chunk_config_dict": taken_by_edge,
            "search_range_m": taken_by_edge,
            "hidden_dim": taken_by_edge,
            "min_chunk_size_m": taken_by_edge,
            "offload_optim_frac": taken_by_edge,
            "zero_group": lambda group: {"process_group": group},
            "shard_param_frac": _refuse("shard_param_frac", 1.0, SHARD_PARAM_FRAC),
            "warmup_non_model_data_ratio": _refuse("warmup_non_model_data_ratio", 0.8, RATIOS),
            "steady_cuda_cap_ratio": _refuse("steady_cuda_cap_ratio", 0.9, RATIOS),
            "strict_ddp_mode": _refuse(
                "strict_ddp_mode",
                False,
                "pc's Gemini always shards its chunks (ZeRO-3); for whole parameters on every "
                "rank use pc_comm.DistributedDataParallel or TorchDDPPlugin.",
            ),
            "memstats": _refuse(
                "memstats",
                None,
                "pc has no Colossal-AI MemStats; its 'auto' placement measures non-model memory "
                "itself (GeminiDDP(example_inputs=...)).",
            ),
            "master_weights": _refuse(
                "master_weights",
                True,
                "pc keeps fp32 masters of every chunk shard (a 16-bit update in place loses "
                "small steps); leave it True.",
            ),
            "extra_dp_group": _refuse("extra_dp_group", None, _DATA_PARALLEL),
            "fp8_communication": _refuse("fp8_communication", False, _NO_FP8),
            "use_fp8": _refuse("use_fp8", False, _NO_FP8),
        },
        # The edge runs Colossal-AI's search and passes chunk_size; pc's own
        # search spellings and its group name are not taken at the edge.
        fills=frozenset(
            (
                "process_group",
                "search_range",
                "min_chunk_size",
                "search_range_mb",
                "min_chunk_size_mb",
            )
        ),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        edge = GeminiDDP  # a subclass's TRANSLATION describes its own call
        values = edge.TRANSLATION.arguments(edge.CORE, args, kwargs)
        pc = edge.TRANSLATION.to_pc(edge.CORE, args, kwargs)
        pc["offload_param_frac"] = host_fraction(
            "GeminiDDP", values["offload_param_frac"], values["offload_optim_frac"]
        )
        pc["chunk_size"] = self._chunk_size(values, pc)
        if pc["device"] is None:  # Colossal-AI computes on the current device
            pc["device"] = get_accelerator().get_current_device()
        super().__init__(**pc)

    @staticmethod
    def _chunk_size(values: dict[str, Any], pc: dict[str, Any]) -> int | None:
        """From ``chunk_config_dict``, pc's ``chunk_size`` / ``chunk_per_tensor``,
        or Colossal-AI's search (the step ``hidden_dim``, else 1024)."""
        config = values["chunk_config_dict"]
        given = pc["chunk_size"] is not None or pc["chunk_per_tensor"]
        if config is not None and given:
            raise ValueError(
                "GeminiDDP: chunk_config_dict and pc's chunk_size / chunk_per_tensor both give "
                "the chunk size; pass one of them."
            )
        if given:
            size: int | None = pc["chunk_size"]
            return size
        comm = pc.get("comm")
        group = values["zero_group"]
        world = comm.world_size if comm is not None else world_size("GeminiDDP", group)
        if config is None:
            hidden_dim = values["hidden_dim"]
            if hidden_dim is not None and (
                isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1
            ):
                raise ValueError(f"GeminiDDP(hidden_dim={hidden_dim!r}): a positive int or None.")
            config, _, _ = search_chunk_configuration(
                values["module"],
                values["search_range_m"],
                hidden_dim or 1024,
                values["min_chunk_size_m"],
                process_group=group,
            )
        return chunk_size_of("GeminiDDP(chunk_config_dict=...)", config, world)


class GeminiOptimizer(TranslatedEdge, _pc.GeminiOptimizer):
    """Colossal-AI's ``GeminiOptimizer(optim, module, ...)`` over a
    :class:`GeminiDDP`: loss scaling for fp16 with the given dynamic scale
    (none for bf16 and fp32), ``max_norm`` as the global-norm clip,
    ``verbose`` printing each skipped step. Call ``optimizer.backward(loss)``;
    ``step()`` leaves the gradients cleared."""

    CORE = _pc.GeminiOptimizer
    TRANSLATION = EdgeTranslation(
        _MODULE,
        "GeminiOptimizer",
        no_effect={
            "params_info": (
                "parameter bookkeeping the original's plugin passes for its checkpoints under "
                "tensor parallelism; pc's state dicts name the parameters themselves"
            ),
            "defaults": (
                "keywords the original accepts and ignores (GeminiAdamOptimizer hands its Adam "
                "arguments to both); the wrapped optimizer's hyperparameters apply"
            ),
        },
        handled={
            "optim": lambda optim: {"optimizer": optim},
            "verbose": taken_by_edge,
            **dict.fromkeys(LOSS_SCALE_FIELDS, taken_by_edge),
            "gpu_margin_mem_ratio": refuse_unless(
                "GeminiOptimizer",
                "gpu_margin_mem_ratio",
                0.0,
                "pc does not move optimizer states into spare GPU memory after the first step; "
                "its 'auto' placement plans the device at construction "
                "(GeminiDDP(placement_policy='auto', device_budget_bytes=)).",
            ),
            "norm_type": refuse_unless(
                "GeminiOptimizer", "norm_type", 2.0, "pc clips by the global 2-norm; pass 2.0."
            ),
            "tp_group": refuse_unless("GeminiOptimizer", "tp_group", None, _DATA_PARALLEL),
        },
        fills=frozenset({"optimizer", "loss_scale", "scale_every_precision"}),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        edge = GeminiOptimizer  # GeminiAdamOptimizer's TRANSLATION describes its own call
        values = edge.TRANSLATION.arguments(edge.CORE, args, kwargs)
        pc = edge.TRANSLATION.to_pc(edge.CORE, args, kwargs)
        pc["loss_scale"] = loss_scale_config(values)
        super().__init__(**pc)
        self.verbose: bool = bool(values["verbose"])  # print each skipped step

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = super().step(closure)
        if self.verbose and self.last_step_skipped:
            print(f"pc: gradients overflowed, the step was skipped (loss scale {self.loss_scale})")
        return loss


# What GeminiAdamOptimizer's keywords are: the wrapper's, the rest are Adam's.
_WRAPPER_KEYWORDS = frozenset(GeminiOptimizer.TRANSLATION.signature().parameters).difference(
    ("self", "optim", "module", "defaults")
)


class GeminiAdamOptimizer(GeminiOptimizer):
    """Colossal-AI's ``GeminiAdamOptimizer(model, **defaults)``: a
    :class:`~pc_compat.colossalai.nn.optimizer.HybridAdam` over ``model``'s
    parameters in a :class:`GeminiOptimizer`. The keywords the
    GeminiOptimizer takes (``initial_scale``, ``max_norm``, ...) go to it,
    the others to HybridAdam (``lr``, ``betas``, ...)."""

    TRANSLATION = EdgeTranslation(
        _MODULE, "GeminiAdamOptimizer", handled={"model": taken_by_edge, "defaults": taken_by_edge}
    )

    def __init__(self, model: torch.nn.Module, **defaults: Any) -> None:
        wrapper = {k: v for k, v in defaults.items() if k in _WRAPPER_KEYWORDS}
        adam = {k: v for k, v in defaults.items() if k not in _WRAPPER_KEYWORDS}
        super().__init__(HybridAdam(model.parameters(), **adam), model, **wrapper)


install(GeminiDDP)
install(GeminiOptimizer)
