"""The model-level switches some plugins' options offer
(``enable_flash_attention``, ``enable_fused_normalization``,
``enable_all_optimization``), applied to the model in place."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

__all__ = ["apply_optimizations"]


def apply_optimizations(model: nn.Module, options: Any) -> None:
    """``enable_flash_attention`` / ``enable_fused_normalization`` /
    ``enable_all_optimization`` of a plugin's ``options`` on ``model``, in
    place."""
    if options.flash_attention():
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise ValueError(
                f"enable_flash_attention: {type(model).__name__} is not a transformers model "
                "whose attention pc can switch to scaled_dot_product_attention."
            )
        setter("sdpa")
    if options.fused_normalization():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and not isinstance(module, nn.RMSNorm):
                eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
                if eps is None or getattr(module, "weight", None) is None:
                    continue
                module.forward = partial(_fused_rms_norm, module, float(eps))


def _fused_rms_norm(module: nn.Module, eps: float, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMS norm (in fp32, scaled by the weight in the input's
    dtype) through torch's fused kernel."""
    normed = torch.nn.functional.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps)
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return weight * normed.to(hidden.dtype)
