"""The optimizer of an expert-parallel model: one over the dense
parameters (ZeRO over the data-parallel ranks, or the user's optimizer
rebuilt), one over this rank's expert shards, stepped as one.

[Note: expert-parallel optimizer]
Dense gradients are averaged over the data-parallel ranks (pc-comm DDP
ignoring the experts, or ZeRO); expert gradients arrive on their rank
already divided by ep [Note: expert gradients] and are averaged here over
the expert-data-parallel group (the ranks holding the same experts) when it
has more than one rank. Both inner optimizers are the user's class with the
user's param groups (each group's dense parameters in one, its expert
parameters in the other). The dense optimizer's groups are this
optimizer's ``param_groups``: what an LR scheduler or the user changes
there is copied into the experts' groups (every key but ``params``) before
each step, so one schedule drives both. Expert optimizer states are 1/ep of
the whole, like the shards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import rebuild_optimizer

__all__ = ["ExpertParallelOptimizer", "split_optimizer"]


def split_optimizer(
    optimizer: Optimizer, names: dict[int, str], model: nn.Module, is_expert: Callable[[Any], bool]
) -> tuple[Optimizer, Optimizer]:
    """The user's optimizer rebuilt twice over ``model``'s parameters (by
    name, as ``names`` gives the originals'): over the dense ones, and over
    the expert shards; every param group in both, some perhaps empty."""
    params = dict(model.named_parameters())
    dense = {n: p for n, p in params.items() if not is_expert(p)}
    experts = {n: p for n, p in params.items() if is_expert(p)}
    return (
        rebuild_optimizer(optimizer, names, dense, skip_missing=True),
        rebuild_optimizer(optimizer, names, experts, skip_missing=True),
    )


class ExpertParallelOptimizer(Optimizer):
    """Dense and expert optimizers stepped as one [Note: expert-parallel
    optimizer]."""

    def __init__(
        self, dense: Optimizer, experts: Optimizer, expert_data_group: dist.ProcessGroup | None
    ) -> None:
        # Optimizer.__init__ is not called: the groups are the dense
        # optimizer's own (schedulers write them); the step hooks' tables
        # torch's register_step_* methods use are made here.
        self.dense: Optimizer = dense
        self.experts = experts
        self.expert_data_group = expert_data_group
        self.defaults = dense.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.dense.param_groups
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.dense.param_groups = groups

    @property
    def state(self) -> Any:
        return self.dense.state

    @state.setter
    def state(self, state: Any) -> None:
        self.dense.state = state

    def __repr__(self) -> str:
        return f"ExpertParallelOptimizer(dense={self.dense!r}, experts={self.experts!r})"

    def backward(self, loss: torch.Tensor) -> None:
        """Through the dense optimizer when it runs backward itself (ZeRO's)."""
        run = getattr(self.dense, "backward", None)
        if callable(run):
            run(loss)
        else:
            loss.backward()  # type: ignore[no-untyped-call, unused-ignore]

    def parts(self) -> tuple[Optimizer, Optimizer]:
        """The dense optimizer and the experts'."""
        return self.dense, self.experts

    def expert_parameters(self) -> list[torch.Tensor]:
        return [p for g in self.experts.param_groups for p in g["params"]]

    def _average_expert_gradients(self) -> None:
        group = self.expert_data_group
        if group is None or dist.get_world_size(group) == 1:
            return
        grads = [p.grad for p in self.expert_parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _sync_hyperparameters(self) -> None:
        for mine, theirs in zip(self.dense.param_groups, self.experts.param_groups, strict=True):
            for key, value in mine.items():
                if key != "params":
                    theirs[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A rank none of whose experts got a token this step still steps them
        # (a zero gradient), as the unsplit model steps its whole tensor.
        for param in self.expert_parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        self._average_expert_gradients()
        self._sync_hyperparameters()
        self.dense.step()
        self.experts.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.experts.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's states, per part (``booster.save_optimizer`` writes
        the canonical form that loads at any ep size)."""
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"dense", "experts"}:
            raise ValueError(
                "an expert-parallel optimizer loads what its state_dict() gave on this rank "
                f"(keys 'dense' and 'experts'), got keys {sorted(state_dict)[:5]}; for a "
                "checkpoint from another layout use booster.load_optimizer."
            )
        self.dense.load_state_dict(state_dict["dense"])
        self.experts.load_state_dict(state_dict["experts"])
