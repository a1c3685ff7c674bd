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

__all__ = ["adam_storing", "check_own_masters", "check_storable"]

# The hyperparameters torch's Adam / AdamW and pc-offload's share.
_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def check_storable(
    optimizer: Optimizer, state_dtype: str | StateDtype, nvme_offload_fraction: float = 0.0
) -> StateDtype:
    """``state_dtype`` parsed, when ``optimizer`` can keep its moments that
    way: any optimizer in fp32; narrow, torch's Adam / AdamW (which
    :func:`adam_storing` converts) or pc-offload's Adam built with it.
    ``nvme_offload_fraction`` > 0 (that share of the states on the disk
    tier, [Note: the NVMe tier] in pc_offload.nvme) asks the same of the
    optimizer: torch's Adam / AdamW, or pc-offload's built with that share."""
    states = parse_state_dtype(state_dtype)
    _check_disk_share(optimizer, nvme_offload_fraction)
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


def check_own_masters(optimizer: Optimizer, wrapper: str) -> None:
    """Refuses ``bf16_stochastic_round`` under a wrapper that keeps fp32
    masters of bf16 parameters itself (ZeRO, Gemini, FSDP2's mixed
    precision): the optimizer steps those fp32 masters, never the bf16
    weights, so the option would change nothing while the run believed
    its masters were bf16 [Note: low-precision optimizer states]."""
    if getattr(optimizer, "bf16_stochastic_round", False):
        raise ValueError(
            f"{type(optimizer).__name__}(bf16_stochastic_round=True) under {wrapper} with "
            "bf16 parameters: the wrapper keeps fp32 masters of them and the optimizer steps "
            "those, so there are no bf16 masters to round. Drop the option (fp32 masters, 4 "
            "bytes a parameter), or train a bf16 model the optimizer steps itself (one "
            "process, or pc_comm.DistributedDataParallel over it) to keep bf16 masters."
        )


def _check_disk_share(optimizer: Optimizer, fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise TypeError(f"nvme_offload_fraction must be a number in [0, 1], got {fraction!r}.")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"nvme_offload_fraction must be in [0, 1], got {fraction}.")
    if fraction == 0.0:
        return
    if isinstance(optimizer, (CPUAdam, CPUAdamW)):
        if optimizer.nvme_offload_fraction != fraction:
            raise ValueError(
                f"nvme_offload_fraction={fraction:g} but the {type(optimizer).__name__} given "
                f"puts {optimizer.nvme_offload_fraction:g} of its states on disk; build it with "
                f"nvme_offload_fraction={fraction:g}, or pass torch's AdamW."
            )
        return
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"nvme_offload_fraction={fraction:g} puts Adam's states on disk; it applies to "
            f"torch.optim.Adam / AdamW or pc_offload's CPUAdam family, got "
            f"{type(optimizer).__name__}. Use nvme_offload_fraction=0 with it."
        )


def adam_storing(
    optimizer: Optimizer,
    state_dtype: str | StateDtype,
    *,
    on_host: bool,
    params: Sequence[Sequence[torch.Tensor]] | None = None,
    nvme_offload_fraction: float = 0.0,
    nvme_offload_dir: str | None = None,
) -> Optimizer:
    """``optimizer`` (torch's Adam or AdamW) as pc-offload's Adam with the
    same hyperparameters per group, its moments stored as ``state_dtype``:
    :class:`CPUAdamW` / :class:`CPUAdam` (L2 decay, as torch's Adam) when
    ``on_host``, else :class:`HybridAdam`, stepping each tensor where it
    lives. ``params``: each group's tensors (default: the optimizer's).
    ``nvme_offload_fraction`` / ``nvme_offload_dir``: the share of the
    states stepped on the host kept on the disk tier, and where.
    pc-offload's own Adams are kept when they already store ``state_dtype``
    (and that share); anything else is refused, naming what to pass."""
    states = check_storable(optimizer, state_dtype, nvme_offload_fraction)
    if isinstance(optimizer, (CPUAdam, CPUAdamW)) and not params:
        return optimizer
    tensors = params if params is not None else [g["params"] for g in optimizer.param_groups]
    groups: list[dict[str, Any]] = [
        {"params": list(ps), **{k: g[k] for k in _KEYS if k in g}}
        for g, ps in zip(optimizer.param_groups, tensors, strict=True)
    ]
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    disk: dict[str, Any] = {
        "nvme_offload_fraction": nvme_offload_fraction,
        "nvme_offload_dir": nvme_offload_dir,
    }
    if not on_host:
        return HybridAdam(groups, adamw_mode=decoupled, state_dtype=states, **disk)
    if decoupled:
        return CPUAdamW(groups, state_dtype=states, **disk)
    return CPUAdam(groups, adamw_mode=False, state_dtype=states, **disk)  # torch's Adam: L2
