"""The gradients and optimizer of an expert-parallel model.

Without ZeRO, the user's optimizer is rebuilt over every parameter (dense
and expert shards), and :class:`ExpertGradientSync` averages the experts'
gradients over the expert-data-parallel ranks at the end of each backward
[Note: expert gradients without ZeRO]. With ZeRO, two ZeRO optimizers, one
over the dense parameters (data-parallel ranks) and one over this rank's
expert shards (expert-data-parallel ranks), are stepped as one
(:class:`ExpertParallelOptimizer`).

[Note: expert gradients without ZeRO]
pc-comm DDP averages the dense gradients over the data-parallel ranks and
ignores the experts. Their gradients arrive on their rank already divided by
ep [Note: expert gradients]. At the end of every backward (a callback the
first expert gradient queues on autograd's engine, as DDP's reducer does),
each expert shard without a gradient gets zeros. Then, where the
expert-data-parallel group has more than one rank, the gradients are
averaged over it. The zeros match the unsplit model, whose packed tensor
has a gradient whenever any expert got a token. Averaging after each
backward of an accumulation is the same as averaging once, since the
average is linear. So the clip, the fp16 unscale and the step that follow
see every gradient at its final value, whichever runs first.

[Note: expert-parallel optimizer]
With ZeRO, the user's optimizer is rebuilt twice, with the user's class
and param groups: each group's dense parameters go to a ZeRO optimizer
over the data-parallel ranks, its expert shards to one over the
expert-data-parallel ranks (the ranks holding the same experts), which
averages their gradients (already divided by ep [Note: expert gradients]).
The dense optimizer's groups are this optimizer's ``param_groups``. What an
LR scheduler or the user changes there is copied into the experts' groups
(every key but ``params``) before each step, so one schedule drives both.
Expert optimizer states are 1/ep of the whole, like the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import rebuild_optimizer
from pc_booster.plugin import Boosted, BoostRequest
from pc_booster.plugins.low_level_zero import masters_from_built
from pc_booster.step_policies import GradientStep
from pc_booster.wrappers import OptimizerView
from pc_zero import LowLevelZeroOptimizer

if TYPE_CHECKING:
    from pc_booster.plugins.hybrid import HybridParallelPlugin

__all__ = [
    "ExpertGradientSync",
    "ExpertParallelOptimizer",
    "configure_experts",
    "expert_zero",
    "split_optimizer",
]


def configure_experts(
    plugin: HybridParallelPlugin,
    request: BoostRequest,
    model: nn.Module,
    names: dict[int, str],
    built: dict[int, torch.Tensor],
) -> Boosted:
    """HybridParallelPlugin's boost under expert parallelism (without
    pipelines), the model placed with its experts split over the ep group:
    dense gradients averaged over the data-parallel ranks (DDP ignoring the
    experts, or ZeRO over the dense parameters), expert gradients over the
    expert-data-parallel ranks ([Note: expert gradients without ZeRO], or
    ZeRO over them [Note: expert-parallel optimizer])."""
    from pc_tensor import is_expert_parameter

    layout = plugin.layout
    experts = [p for p in model.parameters() if is_expert_parameter(p)]
    if plugin.zero_stage:
        if request.optimizer is None:
            raise ValueError("zero_stage > 0 shards an optimizer: pass one to boost().")
        both = expert_zero(plugin, request.optimizer, names, model, built)
        step_policy = GradientStep("HybridParallelPlugin")
        return request.boosted(model, both, module=model, step_policy=step_policy)
    ExpertGradientSync(experts, layout.expert_data_group)
    wrapped: nn.Module = model
    if dist.get_world_size(layout.dp_group) > 1:
        from pc_comm import DistributedDataParallel

        o = plugin.options
        wrapped = DistributedDataParallel(
            model,
            process_group=layout.dp_group,
            bucket_cap_mb=o.ddp_bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            broadcast_buffers=o.broadcast_buffers,
            ignored_parameters=experts,
        )
    optimizer = request.optimizer
    if optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
    return request.boosted(
        wrapped, optimizer, module=model, step_policy=plugin.step_policy(request.precision)
    )


def expert_zero(
    plugin: HybridParallelPlugin,
    optimizer: Optimizer,
    names: dict[int, str],
    model: nn.Module,
    built: dict[int, torch.Tensor],
    own_names: dict[int, str] | None = None,
) -> ExpertParallelOptimizer:
    """The user's optimizer as two ZeRO optimizers, dense and experts,
    stepped as one [Note: expert-parallel optimizer]; ``model``'s parameters
    (a pipeline stage's: those ``own_names`` names)."""
    from pc_tensor import is_expert_parameter

    dense, expert = split_optimizer(optimizer, names, model, is_expert_parameter, own_names)
    parts = (
        plugin.zero_optimizer(dense, own_names, experts=False),
        plugin.zero_optimizer(expert, own_names, experts=True),
    )
    for zero in parts:
        masters_from_built(model, zero, built)
    return ExpertParallelOptimizer(*parts)


class ExpertGradientSync:
    """[Note: expert gradients without ZeRO]: zeros for experts no token
    reached, then the average over ``group``, at the end of each backward.
    The hooks are on pc's own expert shards (made by ``shard_experts``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._queued = False
        # Bound, not weak: nothing else holds this object, its hooks keep it
        # alive as long as the expert shards (pc_comm.weak_method's cycle is
        # then the shards' own: they go together or not at all).
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
            for p in self.params
        ]

    def _arrived(self, _: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @torch.no_grad()
    def _finish(self) -> None:
        self._queued = False
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self.group is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def split_optimizer(
    optimizer: Optimizer,
    names: dict[int, str],
    model: nn.Module,
    is_expert: Callable[[Any], bool],
    own_names: dict[int, str] | None = None,
) -> tuple[Optimizer, Optimizer]:
    """The user's optimizer rebuilt twice over ``model``'s parameters (by
    name, as ``names`` gives the originals'; only those ``own_names`` names
    when given, a pipeline stage's): over the dense ones, and over the
    expert shards; every param group in both, some perhaps empty."""
    params = dict(model.named_parameters())
    if own_names is not None:
        mine = set(own_names.values())
        params = {n: p for n, p in params.items() if n in mine}
    dense = {n: p for n, p in params.items() if not is_expert(p)}
    experts = {n: p for n, p in params.items() if is_expert(p)}
    return (
        rebuild_optimizer(optimizer, names, dense, skip_missing=True),
        rebuild_optimizer(optimizer, names, experts, skip_missing=True),
    )


class ExpertParallelOptimizer(OptimizerView):
    """Dense and expert ZeRO optimizers stepped as one, with one global
    norm and one fp16 overflow decision (``pc_zero.step_together``)
    [Note: expert-parallel optimizer]; the groups, state and defaults shown
    are the dense one's (schedulers write them)."""

    def __init__(self, dense: LowLevelZeroOptimizer, experts: LowLevelZeroOptimizer) -> None:
        self.dense: LowLevelZeroOptimizer = dense
        self.experts = experts
        self._hook_tables()

    @property
    def max_norm(self) -> float:
        """The plugin's clip at every step (both parts')."""
        return self.dense.max_norm

    @max_norm.setter
    def max_norm(self, value: float) -> None:
        self.dense.max_norm = self.experts.max_norm = float(value)

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step by the global norm of both parts' gradients."""
        self.dense.clip_next_step(max_norm)
        self.experts.clip_next_step(max_norm)

    @property
    def scaler(self) -> Any:
        """fp16's loss scaler (the dense part's; the experts' keeps step)."""
        return self.dense.scaler

    @property
    def loss_scale(self) -> float:
        return self.dense.loss_scale

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s accumulated gradient, from the part holding it."""
        from pc_tensor import is_expert_parameter

        part = self.experts if is_expert_parameter(param) else self.dense
        return part.accumulated_grad(param)

    def no_sync(self) -> Any:
        """ZeRO-1's gradient accumulation without communication, both parts."""
        from contextlib import ExitStack

        stack = ExitStack()
        stack.enter_context(self.dense.no_sync())
        stack.enter_context(self.experts.no_sync())
        return stack

    def viewed(self) -> Optimizer:
        return self.dense

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
        self._sync_hyperparameters()
        from pc_zero import step_together

        step_together([self.dense, self.experts])
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
