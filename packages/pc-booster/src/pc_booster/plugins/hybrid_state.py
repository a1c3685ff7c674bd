"""The canonical state of :class:`~pc_booster.plugins.hybrid.HybridParallelPlugin`:
tensor-parallel shards gathered (or split on load) by pc-tensor's specs,
each pipeline stage's weights taken from the stage that trains them, and
the ZeRO masters where they are the true values."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState, names_by_id
from pc_booster.plugins.common import (
    device,
    load_cast,
    sharded,
    torch_load_optimizer,
    torch_optimizer_state,
)
from pc_booster.plugins.low_level_zero import (
    zero_load_masters,
    zero_load_optimizer,
    zero_masters,
    zero_optimizer_state,
)
from pc_booster.plugins.tp_state import shard_optimizer_state, unshard_optimizer_state
from pc_chunk import is_lazy

if TYPE_CHECKING:
    from pc_booster.plugins.hybrid import HybridParallelPlugin

__all__ = [
    "every_stage",
    "from_owning_stages",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
]


def model_state_dict(plugin: HybridParallelPlugin, model: nn.Module) -> dict[str, torch.Tensor]:
    return from_owning_stages(plugin, _local_model_state(plugin, model))


def from_owning_stages(
    plugin: HybridParallelPlugin, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Under pipelines, each weight from the stage that trains it
    (collective over the pipeline ranks); ``state`` itself otherwise."""
    if plugin.pp_size > 1:
        group = plugin.layout.pp_group
        for key in sorted(state):
            owner = plugin.stage.stage_of.get(key, 0)
            value = state[key].to(device())
            dist.broadcast(value, dist.get_global_rank(group, owner), group=group)
            state[key] = value.cpu()
    return state


def _local_model_state(plugin: HybridParallelPlugin, model: nn.Module) -> dict[str, torch.Tensor]:
    boosted = plugin.boosted(model)
    module = boosted.module
    masters = zero_masters(module, sharded(boosted.optimizer)) if plugin.zero_stage else {}
    if plugin.tp_size == 1:
        state = _materialized_state(module)
        state.update(masters)
        return state
    from pc_tensor import full_state_dict, shard_info, unshard_tensor

    state = {k: v.float().cpu() for k, v in full_state_dict(module).items()}
    info = shard_info(module)
    for name, value in masters.items():
        spec = info.specs.get(name)
        state[name] = (
            unshard_tensor(value.to(device()), spec, info.group).cpu()  # NCCL gathers on device
            if spec is not None
            else value
        )
    return state


def _materialized_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state this stage holds: another stage's weights of a lazily
    built model were never materialised here (the owner's broadcast
    replaces them), so they read as zeros of their shape."""
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        real = not (value.is_meta or is_lazy(value))
        out[key] = value.detach().float().cpu().clone() if real else torch.zeros(value.shape)
    return out


def load_model_state_dict(
    plugin: HybridParallelPlugin, model: nn.Module, state: dict[str, torch.Tensor]
) -> None:
    boosted = plugin.boosted(model)
    module = boosted.module
    if plugin.tp_size == 1:
        _load_local(module, state)
        if plugin.zero_stage:
            zero_load_masters(module, sharded(boosted.optimizer), state)
        return
    from pc_tensor import load_full_state_dict, shard_info, shard_tensor

    load_full_state_dict(module, state)
    if plugin.zero_stage and boosted.optimizer is not None:
        info = shard_info(module)
        local = dict(module.named_parameters())
        pieces = {
            name: shard_tensor(value, info.specs[name], info.group, local[name].shape)
            if name in info.specs
            else value
            for name, value in state.items()
            if name in local
        }
        zero_load_masters(module, sharded(boosted.optimizer), pieces)


def _load_local(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the tensors this rank materialised (its stage's)."""
    own = module.state_dict(keep_vars=True)
    real = {k: v for k, v in state.items() if k in own and not (own[k].is_meta or is_lazy(own[k]))}
    if len(real) == len(own):
        load_cast(module, state)
        return
    with torch.no_grad():
        for key, value in real.items():
            own[key].copy_(value.to(own[key].dtype))


def optimizer_state_dict(
    plugin: HybridParallelPlugin, optimizer: Optimizer
) -> CanonicalOptimizerState:
    module = plugin.boosted(optimizer).module
    if plugin.zero_stage:
        canonical = zero_optimizer_state(sharded(optimizer), module)
    else:
        canonical = torch_optimizer_state(optimizer, module)
    if plugin.tp_size > 1:
        canonical = unshard_optimizer_state(module, canonical)
    return every_stage(plugin, canonical)


def every_stage(
    plugin: HybridParallelPlugin, canonical: CanonicalOptimizerState
) -> CanonicalOptimizerState:
    """Under pipelines, every stage's part of the canonical optimizer state,
    on every rank (collective over the pipeline ranks)."""
    if plugin.pp_size > 1:
        parts: list[Any] = [None] * plugin.pp_size
        dist.all_gather_object(parts, canonical, group=plugin.layout.pp_group)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part["state"])
        groups = [
            {**g, "params": [n for part in parts for n in part["param_groups"][i]["params"]]}
            for i, g in enumerate(canonical["param_groups"])
        ]
        canonical = {**canonical, "state": merged, "param_groups": groups}
    return canonical


def load_optimizer_state_dict(
    plugin: HybridParallelPlugin, optimizer: Optimizer, state: CanonicalOptimizerState
) -> None:
    module = plugin.boosted(optimizer).module
    if plugin.pp_size > 1:  # this stage's parameters only
        by_id = names_by_id(module)
        params = (
            sharded(optimizer).params
            if plugin.zero_stage
            else [p for g in optimizer.param_groups for p in g["params"]]
        )
        mine = {by_id[id(p)] for p in params if id(p) in by_id}
        state = {
            **state,
            "state": {n: v for n, v in state["state"].items() if n in mine},
            "param_groups": [
                {**g, "params": [n for n in g["params"] if n in mine]}
                for g in state["param_groups"]
            ],
        }
    if plugin.tp_size > 1:
        local = {n: p.shape for n, p in module.named_parameters()}
        state = shard_optimizer_state(module, state, local)
    if plugin.zero_stage:
        zero_load_optimizer(sharded(optimizer), module, state)
    else:
        torch_load_optimizer(optimizer, module, state)
