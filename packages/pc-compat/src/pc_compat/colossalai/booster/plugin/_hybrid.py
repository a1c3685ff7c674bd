"""How Colossal-AI's ``HybridParallelPlugin`` arguments that pc's plugin does
not take become pc's options [Note: edges from signatures in pc_compat.surface].

- ``enable_all_optimization``: ``enable_flash_attention`` and
  ``enable_fused_normalization`` (pc has no jit-fused kernels; torch's
  fused attention and RMS norm are what the flags ask for).
- ``sequence_parallelism_mode="ring"``: Megatron-style sequence parallelism
  over the tensor-parallel ranks with ring communication; pc's
  ``"split_gather"`` computes the same values.
- ``communication_dtype``: None or fp32 (pc reduces gradients in fp32).
- ``enable_metadata_cache``: pc infers the shapes crossing stages once per
  micro-batch shape and keeps them, which is what True asks; False has no
  effect on values.
- ``make_vocab_size_divisible_by``: pc pads the vocabulary to a multiple of
  ``tp_size`` only, as the shards need; the padding rows take no part in
  the loss, so the values are the same.
- what Colossal-AI ignores in the mode asked, the edge ignores too:
  ``sequence_parallelism_mode`` without ``enable_sequence_parallelism``,
  ``cpu_offload`` with ``zero_stage=0`` (it offloads ZeRO's states), and
  ``overlap_communication`` / ``zero_bucket_size_in_m`` with
  ``zero_stage=0`` (ZeRO's buckets; MoeHybridParallelPlugin defaults
  ``overlap_communication`` to False);
- ``scheduler_nodes``: ``PipelineGraph(...).get_v_schedule()`` with
  ``pp_style="zbv"`` has no effect (pc builds its own ZB-V schedule from the
  stage and micro-batch counts);
- refused with the reason when not at their defaults: ``enable_jit_fused``,
  ``fp8_communication``, ``use_fp8``, ``custom_policy`` (Colossal-AI policy
  objects), ``check_reduction`` / ``static_graph`` (torch DDP's),
  ``dp_outside=False``, other ``scheduler_nodes``, ``inner_ring_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pc_compat.colossalai.pipeline.schedule.v_schedule import PcVSchedule

__all__ = ["HYBRID_HANDLED", "HYBRID_NO_EFFECT", "MOE_HANDLED", "hybrid_to_pc", "moe_hybrid_to_pc"]

HYBRID_NO_EFFECT = {
    "enable_metadata_cache": (
        "pc infers the shapes crossing pipeline stages once per micro-batch shape and keeps "
        "them (what True asks); the values are the same either way"
    ),
    "make_vocab_size_divisible_by": (
        "pc pads the vocabulary to a multiple of tp_size only, as the shards need; padding "
        "rows take no part in the loss, so the values are the same"
    ),
}

# Translated together by hybrid_to_pc (listed so the surface test knows the owner).
HYBRID_HANDLED = (
    "enable_all_optimization",
    "sequence_parallelism_mode",
    "communication_dtype",
    "enable_jit_fused",
    "fp8_communication",
    "use_fp8",
    "custom_policy",
    "check_reduction",
    "static_graph",
    "dp_outside",
    "scheduler_nodes",
    "inner_ring_size",
)


def _refusal(given: Mapping[str, Any]) -> str | None:
    if given["enable_jit_fused"]:
        return (
            "enable_jit_fused=True: pc has no jit-fused kernels of its own; torch.compile "
            "fuses the same element-wise ops. Leave it False."
        )
    if given["fp8_communication"] or given["use_fp8"]:
        return (
            "fp8_communication / use_fp8: pc communicates and computes in the parameters' own "
            "dtype; there is no fp8 path. Leave them False."
        )
    if given["custom_policy"] is not None:
        return (
            "custom_policy: pc shards a model from its transformers tensor-parallel plan or a "
            "pc_tensor.Policy registered in pc_tensor.POLICIES, not from a Colossal-AI policy; "
            "register one there and leave custom_policy out."
        )
    if given["communication_dtype"] not in (None, torch.float32):
        return (
            f"communication_dtype={given['communication_dtype']}: pc reduces gradients in "
            "fp32; leave communication_dtype out."
        )
    if given["check_reduction"] or given["static_graph"]:
        return (
            "check_reduction / static_graph are torch DDP's; the hybrid plugin's data "
            "parallelism is pc-comm's DDP (zero_stage=0) or ZeRO; leave them False."
        )
    if not given["dp_outside"]:
        return (
            "dp_outside=False: pc lays ranks out data-parallel outermost, tensor-parallel "
            "innermost (tp ranks are neighbours); leave dp_outside=True."
        )
    nodes = given["scheduler_nodes"]
    if nodes is not None and not (isinstance(nodes, PcVSchedule) and given["pp_style"] == "zbv"):
        return (
            "scheduler_nodes: pc builds each schedule itself (pp_style='1f1b', "
            "'interleaved' or 'zbv'); a PipelineGraph's V schedule is taken with "
            "pp_style='zbv' only. Leave scheduler_nodes out."
        )
    if given["inner_ring_size"] is not None:
        return (
            "inner_ring_size: pc runs ring attention over one ring "
            "(sequence_parallelism_mode='ring_attn'); leave it out."
        )
    return None


def hybrid_to_pc(given: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """pc's HybridParallelPlugin keywords from Colossal-AI's arguments."""
    refused = _refusal(given)
    if refused is not None:
        raise ValueError(f"HybridParallelPlugin: {refused}")
    if given["enable_all_optimization"]:
        out["enable_flash_attention"] = out["enable_fused_normalization"] = True
    mode = given["sequence_parallelism_mode"] if given["enable_sequence_parallelism"] else None
    out["sequence_parallelism_mode"] = "split_gather" if mode == "ring" else mode
    config = given.get("gradient_checkpoint_config")
    if config is not None and config.enabled:  # pc's per-block recomputation of that share
        from pc_compat.colossalai.shardformer import checkpoint_fraction

        out["activation_checkpointing"] = "full"
        out["activation_checkpointing_fraction"] = checkpoint_fraction(config)
    if not given["zero_stage"]:  # ZeRO's settings have no effect without ZeRO
        if given["cpu_offload"]:
            out["cpu_offload"] = False
        out.pop("overlap_communication", None)
        out.pop("zero_bucket_size_in_m", None)
    return out


# MoeHybridParallelPlugin names dp_outside moe_dp_outside and has no
# inner_ring_size; the rest is HybridParallelPlugin's.
MOE_HANDLED = tuple(
    "moe_dp_outside" if name == "dp_outside" else name
    for name in HYBRID_HANDLED
    if name != "inner_ring_size"
)


def moe_hybrid_to_pc(given: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """pc's HybridParallelPlugin keywords (``ep_size`` among them) from
    Colossal-AI's MoeHybridParallelPlugin arguments."""
    renamed = {**given, "dp_outside": given["moe_dp_outside"], "inner_ring_size": None}
    try:
        return hybrid_to_pc(renamed, out)
    except ValueError as error:
        raise ValueError(
            str(error)
            .replace("HybridParallelPlugin:", "MoeHybridParallelPlugin:", 1)
            .replace("dp_outside", "moe_dp_outside")
        ) from None
