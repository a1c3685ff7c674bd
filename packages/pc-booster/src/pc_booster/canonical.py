"""The canonical optimizer state every plugin converts to and from
(``{"state": {parameter name: {key: full tensor or scalar}},
"param_groups": [{hyperparameters..., "params": [parameter names]}]}``),
and the conversions between it and torch's index-keyed form."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "CanonicalOptimizerState",
    "canonical_to_torch",
    "names_by_id",
    "optimizer_names",
    "rebuild_optimizer",
    "torch_groups",
    "torch_to_canonical",
    "without",
]

CanonicalOptimizerState = dict[str, Any]
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def rebuild_optimizer(
    optimizer: Optimizer,
    old_names: dict[int, str],
    new_params: dict[str, nn.Parameter],
    *,
    skip_missing: bool = False,
) -> Optimizer:
    """The same optimizer class, hyperparameters and param groups over the
    parameters a wrapper put in place of the originals (sharded ones),
    matched by name. An optimizer over parameters the model does not have
    is refused."""
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if name is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not the model's; build it over "
                    "model.parameters() (several param groups are fine)."
                )
            if name not in new_params and skip_missing:
                continue  # e.g. a frozen parameter the wrapper does not manage
            params.append(new_params[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    # Each group carries every hyperparameter; the constructor gets the
    # defaults it accepts (``defaults`` may hold keys it does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)


def names_by_id(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def torch_to_canonical(
    state: dict[str, Any], names: Sequence[str | None]
) -> CanonicalOptimizerState:
    """A torch-format optimizer state dict (indices in param-group order)
    to the canonical form; ``names[i]`` is parameter ``i``'s name."""
    out: dict[str, Any] = {}
    for index, value in state["state"].items():
        name = names[int(index)]
        if name is not None:
            out[name] = {
                k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                for k, v in value.items()
            }
    groups = []
    for group in state["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[i] for i in group["params"]]})
    return {"state": out, "param_groups": groups}


def canonical_to_torch(
    state: CanonicalOptimizerState,
    names: Sequence[str | None],
    groups: Sequence[tuple[Sequence[int], dict[str, Any]]],
) -> dict[str, Any]:
    """The canonical form to a torch-format dict for an optimizer whose
    parameter ``i`` (in param-group order) is named ``names[i]`` and whose
    groups are ``(member indices, current hyperparameters)``. Each group
    takes its hyperparameters from the checkpoint's group holding the same
    parameters (its own where the checkpoint has none). Keys other plugins
    add and this one does not use (``master``) are dropped by the caller."""
    index = {n: i for i, n in enumerate(names) if n is not None}
    missing = [n for n in state["state"] if n not in index]
    if missing:
        raise ValueError(
            f"the optimizer checkpoint has state for parameters this model lacks: "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}. Was it saved from another model?"
        )
    saved_group_of = {
        n: g for g, group in enumerate(state["param_groups"]) for n in group["params"]
    }
    out_groups = []
    for members, current in groups:
        saved = {saved_group_of.get(names[i]) for i in members} - {None}
        if len(saved) > 1:
            raise ValueError(
                "the optimizer's param groups differ from the checkpoint's: one group here "
                "holds parameters of several saved groups. Build the param groups as they "
                "were when it was saved."
            )
        source = state["param_groups"][saved.pop()] if saved else current
        hyper = {k: v for k, v in source.items() if k != "params"}
        # How the step runs is this optimizer's business, not the
        # checkpoint's (a ZeRO optimizer steps fused kernels inside).
        hyper.update({k: current[k] for k in _IMPLEMENTATION if k in current})
        out_groups.append({**hyper, "params": list(members)})
    # Copies: tensors read back from one file may be views of one storage
    # (as the writer held them), which in-place optimizer updates must not
    # share.
    return {
        "state": {
            index[n]: {
                k: x.detach().clone() if isinstance(x, torch.Tensor) else x for k, x in v.items()
            }
            for n, v in state["state"].items()
        },
        "param_groups": out_groups,
    }


def torch_groups(optimizer: Optimizer) -> list[tuple[list[int], dict[str, Any]]]:
    """``optimizer``'s groups as (member indices, hyperparameters)."""
    out, offset = [], 0
    for group in optimizer.param_groups:
        members = list(range(offset, offset + len(group["params"])))
        offset += len(members)
        out.append((members, {k: v for k, v in group.items() if k != "params"}))
    return out


def without(state: CanonicalOptimizerState, *keys: str) -> CanonicalOptimizerState:
    """``state`` without the per-parameter entries ``keys``."""
    return {
        **state,
        "state": {
            n: {k: v for k, v in entry.items() if k not in keys}
            for n, entry in state["state"].items()
        },
    }


def optimizer_names(optimizer: Optimizer, names: dict[int, str]) -> list[str | None]:
    """Each parameter's name, in the optimizer's param-group order."""
    return [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
