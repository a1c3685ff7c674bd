"""How Colossal-AI's ``GeminiPlugin`` arguments that pc's plugin does not
take become pc's options [Note: edges from signatures in pc_compat.surface].

- ``offload_optim_frac``: a chunk's optimizer states live with its shard, so
  the share of chunks on the host is ``offload_param_frac``, or when only
  ``offload_optim_frac`` is given, that one (the shards go with their
  states: less device memory than asked, not more); two different
  fractions are refused.
- ``max_prefetch``: 0 gathers each chunk when it is needed, 1 or more the
  next one ahead (pc prefetches one chunk; more changes no value).
- ``enable_all_optimization``: ``enable_flash_attention`` and
  ``enable_fused_normalization``.
- ``chunk_config_dict``: ``{world_size: {"chunk_size": n, ...}}`` (what
  ``search_chunk_configuration`` returns) fixes pc's ``chunk_size``.
- refused with the reason when not at their defaults: ``shard_param_frac``
  below 1, ``norm_type``
  other than 2, ``master_weights=False``, ``memstats``, ``strict_ddp_mode``,
  sequence parallelism, jit-fused kernels, fp8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = ["GEMINI_HANDLED", "GEMINI_NO_EFFECT", "gemini_to_pc"]

GEMINI_NO_EFFECT = {
    "chunk_init_device": (
        "where Colossal-AI first builds chunks before moving them; pc builds each rank's "
        "share where it lives, and the values are the same"
    ),
    "enable_gradient_accumulation": (
        "pc's Gemini accumulates over backwards either way (booster.no_sync); with "
        "step_in_backward accumulation is refused when it is asked for"
    ),
    "warmup_non_model_data_ratio": (
        "a tuning knob of Colossal-AI's 'auto' placement; pc's keeps chunks on the device "
        "within device_budget_bytes"
    ),
    "steady_cuda_cap_ratio": (
        "a tuning knob of Colossal-AI's 'auto' placement; pc's keeps chunks on the device "
        "within device_budget_bytes"
    ),
    "gpu_margin_mem_ratio": (
        "which optimizer states Colossal-AI's 'auto' placement steps on the GPU; pc steps a "
        "chunk's states where its shard lives, with the same values"
    ),
    "enable_async_reduce": "pc always reduces a chunk's gradients while backward goes on",
}

# Translated together by gemini_to_pc (listed so the surface test knows the owner).
GEMINI_HANDLED = (
    "offload_optim_frac",
    "max_prefetch",
    "enable_all_optimization",
    "chunk_config_dict",
    "shard_param_frac",
    "norm_type",
    "master_weights",
    "memstats",
    "strict_ddp_mode",
    "enable_sequence_parallelism",
    "enable_jit_fused",
    "use_fp8",
    "fp8_communication",
)


def _refusal(given: Mapping[str, Any]) -> str | None:
    if given["shard_param_frac"] != 1.0:
        return (
            f"shard_param_frac={given['shard_param_frac']}: pc's Gemini shards every chunk "
            "over the ranks (1.0); for whole parameters on each rank use LowLevelZeroPlugin."
        )
    if given["norm_type"] != 2.0:
        return f"norm_type={given['norm_type']}: pc clips by the global 2-norm; pass 2.0."
    if not given["master_weights"]:
        return "master_weights=False: pc keeps fp32 masters of each chunk shard; leave it True."
    if given["memstats"] is not None:
        return "memstats: pc traces memory itself; leave it None."
    if given["strict_ddp_mode"]:
        return "strict_ddp_mode=True: pc's Gemini always shards (ZeRO-3); use TorchDDPPlugin."
    if given["enable_sequence_parallelism"] or given["enable_jit_fused"]:
        return (
            "sequence parallelism and jit-fused kernels are HybridParallelPlugin's business "
            "(and pc has no jit-fused kernels); leave them False."
        )
    if given["use_fp8"] or given["fp8_communication"]:
        return "use_fp8 / fp8_communication: pc has no fp8 path; leave them False."
    return None


def _chunk_size(config: Any) -> int:
    """The chunk size of a ``chunk_config_dict`` for this world size."""
    world = dist.get_world_size() if dist.is_initialized() else None
    entries = dict(config)
    entry = entries.get(world) if world in entries else None
    if entry is None and len(entries) == 1:
        entry = next(iter(entries.values()))
    if not isinstance(entry, Mapping) or "chunk_size" not in entry:
        raise ValueError(
            f"GeminiPlugin(chunk_config_dict={config!r}): expected {{world_size: "
            "{'chunk_size': n, ...}}, as search_chunk_configuration returns; pass chunk_size= "
            "to fix the size instead."
        )
    return int(entry["chunk_size"])


def gemini_to_pc(given: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """pc's GeminiPlugin keywords from Colossal-AI's arguments (``given``)."""
    refused = _refusal(given)
    if refused is not None:
        raise ValueError(f"GeminiPlugin: {refused}")
    optim, param = given["offload_optim_frac"], given["offload_param_frac"]
    if optim and param and optim != param:
        raise ValueError(
            f"GeminiPlugin: offload_optim_frac={optim} and offload_param_frac={param}: pc keeps "
            "a chunk's optimizer states with its shard, so one share of the chunks goes to the "
            "host; give one fraction."
        )
    if not 0.0 <= optim <= 1.0:
        raise ValueError(f"GeminiPlugin: offload_optim_frac must be in [0, 1], got {optim}.")
    if optim and not param:
        out["offload_param_frac"] = optim
    prefetch = given["max_prefetch"]
    if prefetch is not None:
        if prefetch < 0:
            raise ValueError(f"GeminiPlugin: max_prefetch must be >= 0, got {prefetch}.")
        out["prefetch"] = prefetch > 0
    if given["enable_all_optimization"]:
        out["enable_flash_attention"] = out["enable_fused_normalization"] = True
    if given["chunk_config_dict"] is not None:
        out["chunk_size"] = _chunk_size(given["chunk_config_dict"])
    return out
