"""How Colossal-AI's ``LowLevelZeroPlugin`` arguments that pc's plugin does
not take become pc's options [Note: edges from signatures in pc_compat.surface].

Refused with the reason when not at their defaults: ``norm_type`` other than
2, ``master_weights=False`` under bf16 / fp16, a ``communication_dtype``
other than the compute dtype (pc's ZeRO reduces gradients in the dtype they
are computed in), and fp8. ``master_weights=False`` in fp32 has no effect:
the parameters are fp32 already. ``extra_dp_size`` is pc's own option
(two-level sharding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LOW_LEVEL_HANDLED", "low_level_to_pc"]

LOW_LEVEL_HANDLED = (
    "norm_type",
    "master_weights",
    "communication_dtype",
    "fp8_communication",
    "use_fp8",
)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _refusal(given: Mapping[str, Any]) -> str | None:
    compute = _DTYPES.get(given["precision"] or "fp32", torch.float32)
    if given["norm_type"] != 2.0:
        return f"norm_type={given['norm_type']}: pc clips by the global 2-norm; pass 2.0."
    if not given["master_weights"] and compute != torch.float32:
        return (
            "master_weights=False: pc keeps fp32 masters of each rank's shard under bf16/fp16 "
            "(the update of a 16-bit parameter in place loses small steps); leave it True."
        )
    dtype = given["communication_dtype"]
    if dtype is not None and dtype != compute:
        return (
            f"communication_dtype={dtype}: pc's ZeRO reduces gradients in the dtype they are "
            f"computed in ({compute}); leave communication_dtype out."
        )
    if given["fp8_communication"] or given["use_fp8"]:
        return "fp8_communication / use_fp8: pc has no fp8 path; leave them False."
    return None


def low_level_to_pc(given: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """pc's LowLevelZeroPlugin keywords from Colossal-AI's arguments."""
    refused = _refusal(given)
    if refused is not None:
        raise ValueError(f"LowLevelZeroPlugin: {refused}")
    return out
