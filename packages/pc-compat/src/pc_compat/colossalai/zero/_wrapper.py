"""``colossalai.zero.zero_model_wrapper`` / ``zero_optim_wrapper``: ZeRO by
stage. Stages 1 and 2 leave the model as it is and wrap the optimizer in
:class:`LowLevelZeroOptimizer` (stage 2: ``partition_grad=True``); stage 3
wraps the model in :class:`GeminiDDP` (``gemini_config`` its keywords) and
the optimizer in :class:`GeminiOptimizer`. The stage travels with the model
(in a table beside it: Colossal-AI writes it on the model). ``max_norm``
clips in every stage (Colossal-AI's stage 3 hands it to GeminiOptimizer
under a name that one ignores)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from pc_compat.colossalai.zero._gemini import GeminiDDP, GeminiOptimizer
from pc_compat.colossalai.zero._low_level import LowLevelZeroOptimizer

__all__ = ["zero_model_wrapper", "zero_optim_wrapper"]

# The stage each wrapped model was wrapped for. Colossal-AI writes it on the
# model (``_colo_zero_stage``); pc keeps it beside the model instead, never
# writing a private attribute on a user's module (at stages 1 and 2 the
# "wrapped" model is the user's own).
_STAGE: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def zero_model_wrapper(
    model: nn.Module,
    zero_stage: int = 1,
    gemini_config: dict[str, Any] | None = None,
    verbose: bool = False,
) -> nn.Module:
    """``model`` for ZeRO ``zero_stage`` (1, 2: itself; 3: a :class:`GeminiDDP`
    built with ``gemini_config`` and ``verbose``)."""
    if zero_stage not in (1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_model_wrapper(zero_stage={zero_stage!r}): 1, 2 or 3.")
    if zero_stage in (1, 2):
        if gemini_config:
            raise ValueError(
                f"zero_model_wrapper(gemini_config=...) configures stage 3 (GeminiDDP); "
                f"zero_stage={zero_stage} leaves the model as it is. Drop gemini_config or pass "
                "zero_stage=3."
            )
        wrapped = model
    else:
        wrapped = GeminiDDP(model, **(gemini_config or {}), verbose=verbose)
    _STAGE[wrapped] = zero_stage
    return wrapped


def zero_optim_wrapper(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    initial_scale: float = 2**16,
    growth_factor: float = 2,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    min_scale: float = 1,
    max_scale: float = 2**32,
    max_norm: float = 0.0,
    norm_type: float = 2.0,
    optim_config: dict[str, Any] | None = None,
    verbose: bool = False,
) -> LowLevelZeroOptimizer | GeminiOptimizer:
    """``optimizer`` wrapped for the stage ``model`` was wrapped for
    (``optim_config``: further keywords of the ZeRO optimizer)."""
    stage = _STAGE.get(model)
    if stage is None:
        raise ValueError(
            "zero_optim_wrapper: the model was not wrapped by zero_model_wrapper; call "
            "model = zero_model_wrapper(model, zero_stage=...) first."
        )
    if norm_type != 2.0:
        raise ValueError(
            f"zero_optim_wrapper(norm_type={norm_type}): the ZeRO optimizers clip by the "
            "global 2-norm; pass 2.0."
        )
    config = dict(optim_config or {})
    config.update(
        initial_scale=initial_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        verbose=verbose,
    )
    if stage in (1, 2):
        return LowLevelZeroOptimizer(
            optimizer, **config, partition_grad=stage == 2, clip_grad_norm=max_norm
        )
    return GeminiOptimizer(optimizer, model, **config, max_norm=max_norm)
