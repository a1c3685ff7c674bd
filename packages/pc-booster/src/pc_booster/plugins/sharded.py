"""Sharded checkpoints: each rank's share of the canonical state as
``torch.distributed.checkpoint`` (DCP) items [Note: sharded canonical state].

[Note: sharded canonical state]
The keys are the same under every plugin, so DCP's resharding makes a
checkpoint saved under any plugin and world size load under any other:

- ``model/<name>``: each parameter's true values in fp32 (the masters where
  a plugin keeps them), and each buffer, with its whole shape;
- ``optim/<name>/<key>``: each element-wise optimizer state (fp32, the
  parameter's shape) and each scalar one (Adam's ``step``, a 0-dim tensor);
- ``optim/param_groups``: the groups' hyperparameters and parameter names;
  ``optim/loss_scaler``: the fp16 loss scale's state, where there is one.

A plugin gives, per key, what this rank holds: a :class:`pc_zero.Pieces`
of flat ranges (ZeRO, chunks), a DTensor (FSDP2) or a whole tensor (every
rank holds it; DCP writes it once). Every rank writes only that, and on
load reads only the byte ranges that overlap it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.plugin import CanonicalOptimizerState, canonical_to_torch, torch_groups

__all__ = [
    "GROUPS",
    "SCALER",
    "after_own_optimizer_load",
    "apply_groups",
    "buffers_state",
    "groups_state",
    "model_key",
    "optim_key",
    "own_optimizer_state",
    "restore_scalars",
    "saved_state_keys",
    "torch_optimizer_targets",
    "whole_state",
    "zero_model_state",
]

GROUPS = "optim/param_groups"
SCALER = "optim/loss_scaler"


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


def whole_state(module: nn.Module) -> dict[str, Any]:
    """Every parameter and persistent buffer as this rank holds it whole
    (or as a DTensor), by canonical key."""
    out: dict[str, Any] = {model_key(n): p.detach() for n, p in module.named_parameters()}
    return {**out, **buffers_state(module)}


def zero_model_state(
    module: nn.Module,
    shapes: Mapping[str, torch.Size],
    pieces: Iterable[tuple[str, int, torch.Tensor]],
) -> dict[str, Any]:
    """A model whose sharded parameters (``shapes``: name -> whole shape)
    keep their true values as fp32 pieces of their flattened values,
    ``(name, start, values)`` for this rank; every other parameter whole."""
    from pc_zero import Pieces

    out: dict[str, Any] = {
        model_key(name): Pieces(shape, torch.float32) for name, shape in shapes.items()
    }
    for name, start, values in pieces:
        out[model_key(name)].add_flat(start, values)
    for name, param in module.named_parameters():
        out.setdefault(model_key(name), param.detach())
    return {**out, **buffers_state(module)}


def buffers_state(module: nn.Module) -> dict[str, Any]:
    """Every persistent buffer, whole (each rank holds it)."""
    persistent = set(module.state_dict())
    return {model_key(n): b.detach() for n, b in module.named_buffers() if n in persistent}


def saved_state_keys(metadata: Mapping[str, Any]) -> dict[str, dict[str, bool]]:
    """Per parameter name, the optimizer-state keys a checkpoint holds and
    whether each is element-wise (a tensor with dimensions) or a scalar."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, dict[str, bool]] = {}
    for fqn, md in metadata.items():
        if not fqn.startswith("optim/") or fqn in (GROUPS, SCALER):
            continue
        name, _, key = fqn.removeprefix("optim/").rpartition("/")
        elementwise = isinstance(md, TensorStorageMetadata) and len(md.size) > 0
        out.setdefault(name, {})[key] = elementwise
    return out


def torch_optimizer_targets(
    optimizer: Optimizer,
    names: Mapping[int, str],
    saved: Mapping[str, Mapping[str, bool]] | None,
) -> dict[str, Any]:
    """A plain torch optimizer's state by canonical key, its state tensors
    themselves (DTensors under FSDP2). ``saved`` (loading): the keys the
    checkpoint has; a parameter without state yet gets zeros to be filled."""
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                continue
            state = optimizer.state[param]
            if saved is not None:
                for key, elementwise in saved.get(name, {}).items():
                    if key not in state:
                        state[key] = (
                            torch.zeros_like(param, dtype=torch.float32)
                            if elementwise
                            else torch.zeros((), dtype=torch.float32)
                        )
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[optim_key(name, key)] = value
                else:  # a Python number: saved as a 0-dim tensor
                    out[optim_key(name, key)] = torch.tensor(float(value))
    return out


def own_optimizer_state(
    module: nn.Module, optimizer: Optimizer, saved: Mapping[str, Mapping[str, bool]] | None
) -> dict[str, Any]:
    """The user's own optimizer over ``module``'s tensors (whole or
    DTensors): its states and groups by canonical key."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        **torch_optimizer_targets(optimizer, names, saved),
        GROUPS: groups_state(optimizer, names),
    }


def after_own_optimizer_load(module: nn.Module, optimizer: Optimizer, state: Any) -> None:
    """The hyperparameters a sharded load read into the user's optimizer."""
    apply_groups(optimizer, {id(p): n for n, p in module.named_parameters()}, state.get(GROUPS))


def groups_state(optimizer: Any, names: Mapping[int, str]) -> list[dict[str, Any]]:
    """The param groups' hyperparameters, with their parameters by name."""
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"] if id(p) in names],
        }
        for group in optimizer.param_groups
    ]


def apply_groups(optimizer: Any, names: Mapping[int, str], saved: Any) -> None:
    """Each group's hyperparameters from the saved group holding the same
    parameters (as the canonical load does)."""
    if not isinstance(saved, list):
        return
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    canonical: CanonicalOptimizerState = {"state": {}, "param_groups": saved}
    converted = canonical_to_torch(canonical, order, torch_groups(optimizer))
    for group, new in zip(optimizer.param_groups, converted["param_groups"], strict=True):
        group.update({k: v for k, v in new.items() if k != "params"})


def restore_scalars(entry: dict[str, Any], state: Mapping[str, Any], name: str) -> None:
    """Put the scalars a sharded load read for parameter ``name`` into an
    optimizer state ``entry`` (its element-wise states were written in
    place), each in the type it had."""
    for key, value in list(entry.items()):
        loaded = state.get(optim_key(name, key))
        if loaded is None or (isinstance(value, torch.Tensor) and value.dim() > 0):
            continue
        entry[key] = (
            loaded.clone() if isinstance(value, torch.Tensor) else type(value)(loaded.item())
        )
