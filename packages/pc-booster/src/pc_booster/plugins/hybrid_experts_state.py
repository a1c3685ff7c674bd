"""Checkpoints of an expert-parallel model (``HybridParallelPlugin(ep_size>1)``)
in the canonical form every plugin reads [Note: sharded canonical state].

Each expert tensor is saved with its whole shape ``[E, ...]``: a rank's
shard is rows ``[r E/ep, (r+1) E/ep)`` of it (a split along dim 0, placed
as a tensor-parallel shard is, over the expert-parallel group). So a
checkpoint saved at one ep size loads at another, and into a plugin
without expert parallelism, and back. With ZeRO the optimizer is two optimizers
[Note: expert-parallel optimizer]; their states and groups are saved under
the same canonical keys as one optimizer's (each group's parameters, dense
and expert, listed together).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState
from pc_booster.plugin import Boosted
from pc_booster.plugins.common import (
    device,
    load_cast,
    sharded,
    torch_load_optimizer,
    torch_optimizer_state,
)
from pc_booster.plugins.experts import ExpertParallelOptimizer
from pc_booster.plugins.hybrid_state import every_stage, from_owning_stages
from pc_booster.plugins.low_level_zero import (
    zero_after_sharded_optimizer_load,
    zero_load_masters,
    zero_load_optimizer,
    zero_masters,
    zero_optimizer_state,
    zero_sharded_model_state,
    zero_sharded_optimizer_state,
)
from pc_booster.plugins.sharded import (
    GROUPS,
    Share,
    after_own_optimizer_load,
    own_optimizer_state,
    whole_state,
)
from pc_booster.wrappers import inner_optimizer

if TYPE_CHECKING:
    from pc_booster.plugins.hybrid import HybridParallelPlugin

__all__ = [
    "after_sharded_model_load",
    "after_sharded_optimizer_load",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
    "sharded_model_state",
    "sharded_optimizer_state",
]


def _rows() -> Any:
    from pc_tensor import ShardSpec

    return ShardSpec(dim=0)


def _expert_names(module: nn.Module) -> set[str]:  # a set: sort it before any collective
    from pc_tensor import is_expert_parameter

    return {n for n, p in module.named_parameters() if is_expert_parameter(p)}


def _share(plugin: HybridParallelPlugin, module: nn.Module, loading: bool = False) -> Share:
    """The plugin's share (under pipelines: this stage's tensors), with the
    expert shards placed as rows of the whole tensors."""
    group = plugin.layout.ep_group
    assert group is not None
    base = plugin.stage_share(module, loading)
    experts = _expert_names(module)
    place = (dist.get_rank(group), dist.get_world_size(group))
    return Share(
        base.names,
        {**base.tp_specs, **dict.fromkeys(experts, _rows())},
        base.tp_rank,
        base.tp_world,
        dict.fromkeys(experts, place),
    )


def _parts(boosted: Boosted) -> tuple[Optimizer, ...]:
    """The optimizers holding the state: ZeRO's two, or the user's rebuilt one."""
    if boosted.optimizer is None:
        return ()
    inner = inner_optimizer(boosted.optimizer)
    return inner.parts() if isinstance(inner, ExpertParallelOptimizer) else (inner,)


def _merge_groups(outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's parameters from every part (the groups correspond)."""
    first = outs[0][GROUPS]
    return [
        {**group, "params": [n for out in outs for n in out[GROUPS][i]["params"]]}
        for i, group in enumerate(first)
    ]


# -- sharded (DCP) ------------------------------------------------------------------


def sharded_model_state(
    plugin: HybridParallelPlugin, boosted: Boosted, loading: bool = False
) -> dict[str, Any]:
    module, share = boosted.module, _share(plugin, boosted.module, loading)
    if not plugin.zero_stage:
        return whole_state(module, share)
    out: dict[str, Any] = {}
    for part in _parts(boosted):
        out.update(zero_sharded_model_state(module, sharded(part), share))
    return out


def after_sharded_model_load(plugin: HybridParallelPlugin, boosted: Boosted) -> None:
    if plugin.zero_stage:
        for part in _parts(boosted):
            sharded(part).sync_params()


def sharded_optimizer_state(
    plugin: HybridParallelPlugin, boosted: Boosted, saved: dict[str, dict[str, bool]] | None
) -> dict[str, Any]:
    module, share = boosted.module, _share(plugin, boosted.module, saved is not None)
    outs = [
        zero_sharded_optimizer_state(module, sharded(part), saved, share)
        if plugin.zero_stage
        else own_optimizer_state(module, part, saved, share)
        for part in _parts(boosted)
    ]
    merged: dict[str, Any] = {}
    for out in outs:
        merged.update(out)
    merged[GROUPS] = _merge_groups(outs)
    if plugin.pp_size > 1 and saved is None:
        merged[GROUPS] = plugin.every_stage_groups(merged[GROUPS])
    return merged


def after_sharded_optimizer_load(
    plugin: HybridParallelPlugin, boosted: Boosted, state: dict[str, Any]
) -> None:
    for part in _parts(boosted):
        if plugin.zero_stage:
            zero_after_sharded_optimizer_load(boosted.module, sharded(part), state)
        else:
            after_own_optimizer_load(boosted.module, part, state)


# -- one file (the canonical state gathered) -------------------------------------------


def _gather(plugin: HybridParallelPlugin, value: torch.Tensor) -> torch.Tensor:
    from pc_tensor import unshard_tensor

    group = plugin.layout.ep_group
    assert group is not None
    return unshard_tensor(value.to(device()), _rows(), group).cpu()


def _slice(plugin: HybridParallelPlugin, value: torch.Tensor, local: torch.Size) -> torch.Tensor:
    group = plugin.layout.ep_group
    assert group is not None
    first = dist.get_rank(group) * local[0]
    return value[first : first + local[0]]


def model_state_dict(plugin: HybridParallelPlugin, boosted: Boosted) -> dict[str, torch.Tensor]:
    module = boosted.module
    masters: dict[str, torch.Tensor] = {}
    for part in _parts(boosted) if plugin.zero_stage else ():
        masters.update(zero_masters(module, sharded(part)))
    if plugin.tp_size > 1:  # the tensor-parallel shards gathered (experts stay whole there)
        from pc_tensor import full_state_dict, shard_info, unshard_tensor

        state = {k: v.float().cpu() for k, v in full_state_dict(module).items()}
        info = shard_info(module)
        for name, value in masters.items():
            spec = info.specs.get(name)
            if spec is not None:
                masters[name] = unshard_tensor(value.to(device()), spec, info.group).cpu()
    else:
        state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    state.update(masters)
    for name in sorted(_expert_names(module)):  # the same order on every rank: collectives
        state[name] = _gather(plugin, state[name])
    return from_owning_stages(plugin, state)


def load_model_state_dict(
    plugin: HybridParallelPlugin, boosted: Boosted, state: dict[str, torch.Tensor]
) -> None:
    module = boosted.module
    local = dict(module.named_parameters())
    experts = _expert_names(module)
    mine = {
        k: _slice(plugin, v, local[k].shape) if k in local and k in experts else v
        for k, v in state.items()
    }
    load_cast(module, mine)
    if plugin.zero_stage:
        for part in _parts(boosted):
            zero_load_masters(module, sharded(part), mine)


def optimizer_state_dict(plugin: HybridParallelPlugin, boosted: Boosted) -> CanonicalOptimizerState:
    module = boosted.module
    parts = [
        zero_optimizer_state(sharded(p), module)
        if plugin.zero_stage
        else torch_optimizer_state(p, module)
        for p in _parts(boosted)
    ]
    experts = _expert_names(module)
    whole = _tp_whole(plugin, module)
    state: dict[str, Any] = {}
    for part in parts:
        for name, entry in part["state"].items():
            state[name] = {
                k: _gather(plugin, v)
                if name in experts and _elementwise(v)
                else whole(name, v)
                if _elementwise(v)
                else v
                for k, v in entry.items()
            }
    groups = [
        {**g, "params": [n for part in parts for n in part["param_groups"][i]["params"]]}
        for i, g in enumerate(parts[0]["param_groups"])
    ]
    return every_stage(plugin, {**parts[0], "state": state, "param_groups": groups})


def _tp_whole(plugin: HybridParallelPlugin, module: nn.Module) -> Any:
    """A tensor-parallel shard's value gathered whole (others as they are)."""
    if plugin.tp_size == 1:
        return lambda name, value: value
    from pc_tensor import shard_info, unshard_tensor

    info = shard_info(module)

    def whole(name: str, value: torch.Tensor) -> torch.Tensor:
        spec = info.specs.get(name)
        if spec is None:
            return value
        return unshard_tensor(value.to(device()), spec, info.group).cpu()

    return whole


def _tp_piece(plugin: HybridParallelPlugin, module: nn.Module) -> Any:
    """This rank's tensor-parallel piece of a whole value (others as given)."""
    if plugin.tp_size == 1:
        return lambda name, value, shape: value
    from pc_tensor import shard_info, shard_tensor

    info = shard_info(module)

    def piece(name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        spec = info.specs.get(name)
        return shard_tensor(value, spec, info.group, shape) if spec is not None else value

    return piece


def _elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def load_optimizer_state_dict(
    plugin: HybridParallelPlugin, boosted: Boosted, state: CanonicalOptimizerState
) -> None:
    module = boosted.module
    local = dict(module.named_parameters())
    experts = _expert_names(module)
    for part in _parts(boosted):
        params = sharded(part).params if plugin.zero_stage else _params(part)
        by_id = {id(p): n for n, p in local.items()}
        names = {by_id[id(p)] for p in params if id(p) in by_id}
        piece = _tp_piece(plugin, module)
        entries = {
            name: {
                k: _slice(plugin, v, local[name].shape)
                if name in experts and _elementwise(v)
                else piece(name, v, local[name].shape)
                if _elementwise(v)
                else v
                for k, v in entry.items()
            }
            for name, entry in state["state"].items()
            if name in names
        }
        groups = [
            {**g, "params": [n for n in g["params"] if n in names]} for g in state["param_groups"]
        ]
        mine: CanonicalOptimizerState = {**state, "state": entries, "param_groups": groups}
        if plugin.zero_stage:
            zero_load_optimizer(sharded(part), module, mine)
        else:
            torch_load_optimizer(part, module, mine)


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]
