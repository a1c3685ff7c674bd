"""torch's Adam / AdamW as one of pc-offload's, for a plugin that steps
on the host or keeps the moments narrow [Note: low-precision optimizer
states]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from pc_offload.optim import CPUAdam, CPUAdamW, HybridAdam
from pc_offload.states import StateDtype, parse_state_dtype

__all__ = ["adam_storing", "check_storable"]

# The hyperparameters torch's Adam / AdamW and pc-offload's share.
_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def check_storable(optimizer: Optimizer, state_dtype: str | StateDtype) -> StateDtype:
    """``state_dtype`` parsed, when ``optimizer`` can keep its moments that
    way: any optimizer in fp32; narrow, torch's Adam / AdamW (which
    :func:`adam_storing` converts) or pc-offload's Adam built with it."""
    states = parse_state_dtype(state_dtype)
    if states is StateDtype.FP32:
        return states
    if isinstance(optimizer, (CPUAdam, CPUAdamW)):
        if optimizer.state_dtype is not states:
            raise ValueError(
                f"optimizer_states={states.value!r} but the {type(optimizer).__name__} given "
                f"stores {optimizer.state_dtype.value!r}; build it with "
                f"state_dtype={states.value!r}, or pass torch's AdamW."
            )
        return states
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"optimizer_states={states.value!r} stores Adam's moments narrow; it applies to "
            f"torch.optim.Adam / AdamW or pc_offload's CPUAdam family, got "
            f"{type(optimizer).__name__}. Use optimizer_states='fp32' with it."
        )
    return states


def adam_storing(
    optimizer: Optimizer,
    state_dtype: str | StateDtype,
    *,
    on_host: bool,
    params: Sequence[Sequence[torch.Tensor]] | None = None,
) -> Optimizer:
    """``optimizer`` (torch's Adam or AdamW) as pc-offload's Adam with the
    same hyperparameters per group, its moments stored as ``state_dtype``:
    :class:`CPUAdamW` / :class:`CPUAdam` (L2 decay, as torch's Adam) when
    ``on_host``, else :class:`HybridAdam`, stepping each tensor where it
    lives. ``params``: each group's tensors (default: the optimizer's).
    pc-offload's own Adams are kept when they already store ``state_dtype``;
    anything else is refused, naming what to pass."""
    states = check_storable(optimizer, state_dtype)
    if isinstance(optimizer, (CPUAdam, CPUAdamW)) and not params:
        return optimizer
    tensors = params if params is not None else [g["params"] for g in optimizer.param_groups]
    groups: list[dict[str, Any]] = [
        {"params": list(ps), **{k: g[k] for k in _KEYS if k in g}}
        for g, ps in zip(optimizer.param_groups, tensors, strict=True)
    ]
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    if not on_host:
        return HybridAdam(groups, adamw_mode=decoupled, state_dtype=states)
    if decoupled:
        return CPUAdamW(groups, state_dtype=states)
    return CPUAdam(groups, adamw_mode=False, state_dtype=states)  # torch's Adam: L2 decay
