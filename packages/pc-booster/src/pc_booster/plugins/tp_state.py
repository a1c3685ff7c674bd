"""The canonical (whole-tensor) state of a model split by pc-tensor's
``shard_model``, from and to each rank's tensor-parallel pieces: shared by
HybridParallelPlugin and GeminiPlugin(tp_size=...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_booster.canonical import CanonicalOptimizerState
from pc_booster.plugins.common import device
from pc_booster.plugins.sharded import Share

__all__ = [
    "shard_optimizer_state",
    "shard_tensors",
    "tp_share",
    "unshard_optimizer_state",
    "unshard_tensors",
]


def tp_share(module: nn.Module, names: frozenset[str] | None = None) -> Share:
    """What this rank holds of a split model's canonical state: its pieces'
    places in the full tensors [Note: sharded canonical state]."""
    from pc_tensor import shard_info

    info = shard_info(module)
    return Share(names, info.specs, dist.get_rank(info.group), dist.get_world_size(info.group))


def unshard_tensors(module: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` (name -> this rank's piece, or a whole tensor) with every
    split tensor gathered whole (collective over the tensor-parallel group,
    in sorted order; on the device: NCCL gathers there)."""
    from pc_tensor import shard_info, unshard_tensor

    info = shard_info(module)
    out: dict[str, Any] = {}
    for name in sorted(state):
        spec = info.specs.get(name)
        value = state[name]
        out[name] = (
            unshard_tensor(value.to(device()), spec, info.group).cpu()
            if spec is not None
            else value
        )
    return out


def shard_tensors(
    module: nn.Module, state: Mapping[str, torch.Tensor], local_shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`unshard_tensors`: this rank's piece of each
    split tensor (``local_shapes``: its shape here)."""
    from pc_tensor import shard_info, shard_tensor

    info = shard_info(module)
    return {
        name: shard_tensor(value, info.specs[name], info.group, local_shapes[name])
        if name in info.specs and name in local_shapes
        else value
        for name, value in state.items()
    }


def _elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def unshard_optimizer_state(
    module: nn.Module, canonical: CanonicalOptimizerState
) -> CanonicalOptimizerState:
    """Each split parameter's element-wise states gathered whole, in place."""
    from pc_tensor import shard_info, unshard_tensor

    info = shard_info(module)
    for name in sorted(canonical["state"]):
        spec = info.specs.get(name)
        if spec is None:
            continue
        entry = canonical["state"][name]
        for key in sorted(entry):
            if _elementwise(entry[key]):
                entry[key] = unshard_tensor(entry[key].to(device()), spec, info.group).cpu()
    return canonical


def shard_optimizer_state(
    module: nn.Module, canonical: CanonicalOptimizerState, local_shapes: Mapping[str, torch.Size]
) -> CanonicalOptimizerState:
    """The inverse of :func:`unshard_optimizer_state` (a new state)."""
    from pc_tensor import shard_info, shard_tensor

    info = shard_info(module)
    entries = {}
    for name, entry in canonical["state"].items():
        spec = info.specs.get(name)
        entries[name] = {
            k: shard_tensor(v, spec, info.group, local_shapes[name])
            if spec is not None and _elementwise(v)
            else v
            for k, v in entry.items()
        }
    return {**canonical, "state": entries}
