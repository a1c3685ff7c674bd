"""torch's FSDP2 (:class:`TorchFSDPPlugin`): ``fully_shard`` on every
transformer block and the root, fp32 shards with an optional bf16 compute
dtype, the optimizer rebuilt over the DTensor shards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState, names_by_id, rebuild_optimizer, without
from pc_booster.clipping import clip_replicated
from pc_booster.plugin import Boosted, BoostRequest, Plugin, SupportsNoSync
from pc_booster.plugins.common import (
    broadcast_module,
    cast_floating,
    device,
    has_lazy,
    materialize_lazy,
    require_initialized,
)
from pc_booster.plugins.fsdp_tp import apply_tensor_parallel, tensor_parallel_plan
from pc_booster.plugins.sharded import (
    after_own_optimizer_load,
    own_optimizer_state,
    whole_state,
)
from pc_booster.rules import (
    LossScaleOptions,
    PluginConfig,
    Rule,
    RunSetting,
    StateBytes,
    TrainPrecision,
    tp_size_problem,
)
from pc_booster.step_policies import AmpStep, GradientStep
from pc_offload import check_own_masters

__all__ = ["TorchFSDPOptions", "TorchFSDPPlugin"]


# [Note: fp16 under FSDP2]
# FSDP2 keeps no loss scale; torch pairs it with a sharded gradient scaler.
# Here the returned optimizer's step policy (AmpStep) is that scaler: fp32
# shards are the masters, forward and backward run in fp16 (the mixed
# precision policy's param_dtype), gradients are reduced in fp32 into the
# shards; before the step each rank unscales its shard and the overflow
# check's sum is all-reduced over every rank, so every rank skips together.


# [Note: FSDP1 arguments]
# TorchFSDPPlugin takes torch FSDP1's arguments (as programs written for
# FSDP1 pass them) and runs FSDP2 (fully_shard), mapping each:
# - sharding_strategy: FULL_SHARD is reshard_after_forward=True,
#   SHARD_GRAD_OP False; HYBRID_SHARD and _HYBRID_SHARD_ZERO2 the same
#   over FSDP2's 2-D mesh (replicate x shard), sharded inside each node
#   (torchrun's LOCAL_WORLD_SIZE ranks), as FSDP1's default intra-node
#   group does; NO_SHARD is refused (TorchDDPPlugin replicates);
# - cpu_offload (CPUOffload(offload_params=True) or True): FSDP2's
#   CPUOffloadPolicy on an accelerator; on a CPU-only machine the shards
#   live in host memory already;
# - auto_wrap_policy: a torch-style callable (module, recurse,
#   nonwrapped_numel) choosing the units, walked as FSDP1 walks it;
# - mixed_precision (FSDP1's MixedPrecision): param_dtype is the run's
#   compute precision, reduce_dtype FSDP2's, buffer_dtype the buffers';
# - backward_prefetch: BACKWARD_PRE is what FSDP2 does (the next unit's
#   all-gather is issued before this unit's backward); BACKWARD_POST is
#   refused;
# - sync_module_states: pc starts every rank from rank 0's values (a lazy
#   model from the same seed) either way;
# - process_group: the default group only (FSDP2 shards over a mesh of
#   every rank here).
# Refused with the FSDP2 way named: param_init_fn, ignored_modules.


_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_KEEPS_GATHERED = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")  # reshard_after_forward=False


def shard_size(strategy: str | None, world: int) -> int:
    """The ranks each parameter is sharded over: under a hybrid strategy,
    a node's (torchrun's LOCAL_WORLD_SIZE), else every rank."""
    if strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return world
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        raise ValueError(
            f"sharding_strategy={strategy} shards inside each node: LOCAL_WORLD_SIZE={local} "
            f"must divide the {world} ranks (launch the same number of processes per node)."
        )
    return local


def _fsdp1_arguments(o: TorchFSDPOptions, setting: RunSetting) -> str | None:
    strategy = o.sharding_strategy
    if strategy is not None and strategy not in _STRATEGIES:
        other = (
            "use TorchDDPPlugin to replicate"
            if strategy == "NO_SHARD"
            else f"pc's TorchFSDPPlugin takes {', '.join(_STRATEGIES)}"
        )
        return f"sharding_strategy={strategy}: {other}."
    if strategy is not None and not o.reshard_after_forward:
        return (
            "sharding_strategy and reshard_after_forward=False both say whether parameters are "
            "freed after forward; give one (SHARD_GRAD_OP is reshard_after_forward=False)."
        )
    if o.auto_wrap_policy is not None and o.wrap_classes is not None:
        return "auto_wrap_policy and wrap_classes both choose the units; give one."
    if o.backward_prefetch not in (None, "BACKWARD_PRE"):
        return (
            f"backward_prefetch={o.backward_prefetch}: FSDP2 issues the next unit's all-gather "
            "before this unit's backward (BACKWARD_PRE); BACKWARD_POST is not offered."
        )
    if o.param_init_fn is not None:
        return (
            "param_init_fn: FSDP2 in pc materialises a model built under "
            "pc_chunk.LazyInitContext (or on the meta device through it) one unit at a time, "
            "each rank its share; build the model that way and drop param_init_fn."
        )
    if o.ignored_modules:
        return (
            "ignored_modules: every parameter is sharded and its gradient reduced; a module "
            "left out would train unsynchronised. Freeze it (requires_grad=False) instead."
        )
    return None


def _tensor_parallel(o: TorchFSDPOptions, setting: RunSetting) -> str | None:
    tp = o.tp_size
    problem = tp_size_problem(tp, setting.world)
    if problem is not None:
        return problem
    if tp > 1 and o.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return (
            f"sharding_strategy={o.sharding_strategy} with tp_size={tp}: hybrid sharding over "
            "tensor-parallel shards (a 3-D mesh) is not built yet. Use FULL_SHARD (or "
            "SHARD_GRAD_OP) with tp_size, or hybrid sharding with tp_size=1."
        )
    return None


def _reduce_dtype(o: TorchFSDPOptions, setting: RunSetting) -> str | None:
    p = setting.precision
    if o.param_dtype is not None and p is not None and p.dtype != o.param_dtype:
        return (
            f"mixed_precision's param_dtype ({o.param_dtype}) and the run's precision "
            f"({p.value}) disagree; give the precision once."
        )
    return None


@dataclass(frozen=True)
class TorchFSDPOptions(PluginConfig, LossScaleOptions):
    """``reshard_after_forward`` is FSDP2's; ``wrap_classes``: the module
    classes each sharded as a unit (default: a ``transformers`` model's
    ``_no_split_modules``); ``max_norm``: clipping by the global norm;
    ``tp_size``: tensor parallelism inside each group of that many
    consecutive ranks, FSDP2 over the groups ([Note: FSDP2 over tensor
    parallelism] in pc_booster.plugins.fsdp_tp)."""

    name: ClassVar[str] = "torch-fsdp"
    gathers_parameters: ClassVar[bool] = True
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "FSDP1 arguments FSDP2 has no counterpart for",
            _fsdp1_arguments,
            ({"sharding_strategy": "NO_SHARD"}, RunSetting()),
        ),
        Rule(
            "tp_size not dividing the ranks, or with hybrid sharding",
            _tensor_parallel,
            ({"tp_size": 3}, RunSetting(world=4)),
        ),
        Rule(
            "mixed_precision's param_dtype against the run's precision",
            _reduce_dtype,
            ({"param_dtype": torch.bfloat16}, RunSetting(precision=TrainPrecision.FP32)),
        ),
    )

    reshard_after_forward: bool = True
    wrap_classes: tuple[type[nn.Module], ...] | None = None
    max_norm: float = 0.0
    # FSDP1's arguments, parsed [Note: FSDP1 arguments]
    sharding_strategy: str | None = None
    cpu_offload: bool = False
    auto_wrap_policy: Any = None
    backward_prefetch: str | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    param_init_fn: Any = None
    ignored_modules: Any = None
    sync_module_states: bool = False
    tp_size: int = 1
    # and fp16's dynamic loss scale (LossScaleOptions) [Note: fp16 under FSDP2]

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        # fp32 shards of parameters, gradients and moments; the compute
        # dtype exists only while a unit is gathered. Hybrid: a node's shard.
        n = min(dp, shard_size(self.sharding_strategy, dp))
        return StateBytes(4 * psi / n, 4 * psi / n, 0.0, 8 * psi / n)


# [Note: meta-device models under FSDP2]
# FSDP2's own pattern builds the model on the meta device, shards it, then
# allocates each rank's shards (to_empty) and initialises them. Here boost
# does the last two: after fully_shard, the model is moved to the run's
# device with to_empty, and its own init_weights() (transformers' and
# torchtitan's convention) fills the shards, and every buffer it computes
# (rotary frequencies); a model without one gets each module's
# reset_parameters(), and is refused if it has buffers (their values would
# be undefined). Each rank fills only its own shards, from a generator
# seeded apart per rank (forked, so the user's generator is left as it
# was): the same seed on every rank would give every shard the same values.
# The values are a fresh initialisation, not those an eager build would
# give; no rank ever holds the whole model.


def _on_meta(model: nn.Module) -> bool:
    from pc_chunk import is_lazy

    return any(t.is_meta and not is_lazy(t) for t in [*model.parameters(), *model.buffers()])


def _check_initialisable(model: nn.Module) -> None:
    if callable(getattr(model, "init_weights", None)):
        return
    if any(True for _ in model.buffers()):
        raise ValueError(
            f"TorchFSDPPlugin: {type(model).__name__} was built on the meta device and has "
            "buffers but no init_weights() to compute them, so their values would be "
            "undefined. Give it an init_weights() method (torchtitan's convention), or build "
            "it under pc_chunk.LazyInitContext instead."
        )


def initialise_meta(model: nn.Module, where: torch.device) -> None:
    """Allocate a sharded meta-device model on ``where`` and initialise it
    [Note: meta-device models under FSDP2]."""
    model.to_empty(device=where)
    rank = dist.get_rank() if dist.is_initialized() else 0
    devices = [where.index or 0] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(torch.initial_seed() + 7919 * (rank + 1))
        init = getattr(model, "init_weights", None)
        if callable(init):
            init()
            return
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


class TorchFSDPPlugin(Plugin, SupportsNoSync):
    """torch's FSDP2 (``fully_shard``) on every transformer block (the
    model's ``_no_split_modules`` for ``transformers`` models, or
    ``wrap_classes``) and the root. A lazily built model is materialised one
    unit at a time, each sharded at once. The optimizer is rebuilt over the
    sharded DTensor parameters with the same class, hyperparameters and
    param groups; the canonical state goes through
    ``torch.distributed.checkpoint``'s state-dict functions."""

    options: TorchFSDPOptions
    initialises_meta = True
    # With tp_size > 1: the (dp, tp) mesh, made when first needed (boost,
    # or a dataloader prepared before it), as HybridParallelPlugin's groups.
    _tp_mesh: Any = None

    OPTIONS = TorchFSDPOptions
    POSITIONAL = ("reshard_after_forward", "wrap_classes", "max_norm")

    def __init__(
        self, *args: Any, process_group: Any = None, mixed_precision: Any = None, **fields: Any
    ) -> None:
        """The fields of :class:`TorchFSDPOptions` (or the options object)
        [Note: options declared once]; FSDP1's objects are read for what
        they say: ``cpu_offload=CPUOffload(...)``, the enums' names,
        ``mixed_precision=MixedPrecision(...)`` as the three dtypes, and
        ``process_group`` (every rank, or refused)."""
        if process_group is not None and (
            not torch.distributed.is_initialized()
            or torch.distributed.get_world_size(process_group) != torch.distributed.get_world_size()
        ):
            raise ValueError(
                "TorchFSDPPlugin: process_group must be None or span every rank; pc's FSDP2 "
                "shards over all of them (run separate jobs for separate groups)."
            )
        dtypes = ("param_dtype", "reduce_dtype", "buffer_dtype")
        if mixed_precision is not None:
            if any(fields.get(name) is not None for name in dtypes):
                raise ValueError(
                    "TorchFSDPPlugin: mixed_precision and param_dtype / reduce_dtype / "
                    "buffer_dtype say the same thing; give one."
                )
            fields.update({name: getattr(mixed_precision, name, None) for name in dtypes})
        for name in ("sharding_strategy", "backward_prefetch"):
            if name in fields:
                fields[name] = _enum_name(fields[name])
        if "cpu_offload" in fields:
            offload = fields["cpu_offload"]
            fields["cpu_offload"] = bool(getattr(offload, "offload_params", offload))
        super().__init__(self.options_of(args, fields))
        if self.options.param_dtype is not None:
            self.set_precision(TrainPrecision.parse(self.options.param_dtype).value)

    def _units(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded as units, innermost first. A parameter tied
        across modules (BERT's embedding and decoder) must sit in one FSDP
        group: a module holding one whose other owner is outside it stays
        with the root."""
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        owners: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), []).append(name)
        wrap = self.options.wrap_classes
        policy = self.options.auto_wrap_policy
        picked = {id(m) for m in _policy_units(model, policy)} if policy is not None else set()
        units: list[nn.Module] = []
        for prefix, module in list(model.named_modules())[1:]:
            if policy is not None:
                chosen = id(module) in picked
            elif wrap is not None:
                chosen = isinstance(module, wrap)
            else:
                chosen = type(module).__name__ in blocks
            tied_outside = any(
                not n.startswith(prefix + ".") for p in module.parameters() for n in owners[id(p)]
            )
            if chosen and not tied_outside:
                units.append(module)
        # A policy may choose a unit inside another: the inner is sharded first.
        return units[::-1] if policy is not None else units

    def configure(self, request: BoostRequest) -> Boosted:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        model, optimizer, precision = request.model, request.optimizer, request.precision
        require_initialized("TorchFSDPPlugin")
        names = names_by_id(model)
        lazy = has_lazy(model)
        meta = _on_meta(model)
        if meta:
            _check_initialisable(model)
        elif not lazy:
            model = model.to(device())
            broadcast_module(model)
        o = self.options
        if precision is TrainPrecision.BF16 and optimizer is not None:
            # The sharded parameters stay fp32: they are the masters.
            check_own_masters(optimizer, "TorchFSDPPlugin (bf16 mixed precision)")
        policy = MixedPrecisionPolicy(
            param_dtype=precision.dtype if precision is not TrainPrecision.FP32 else None,
            reduce_dtype=o.reduce_dtype or torch.float32,
        )
        # On a CPU-only machine the shards are in host memory already.
        offload = CPUOffloadPolicy() if o.cpu_offload and device().type != "cpu" else None
        reshard = o.reshard_after_forward and o.sharding_strategy not in _KEEPS_GATHERED
        where: dict[str, Any] = {}
        ranks = dist.get_world_size()
        shard = shard_size(o.sharding_strategy, ranks)
        split: dict[nn.Module, str] = {}
        tp_mesh = None
        if o.tp_size > 1:  # [Note: FSDP2 over tensor parallelism]
            split = tensor_parallel_plan(model, o.tp_size)
            mesh = self.mesh()
            where["mesh"], tp_mesh = mesh["dp"], mesh["tp"]
        elif shard < ranks:  # hybrid: FSDP2's 2-D mesh, replicated across nodes
            from torch.distributed.device_mesh import init_device_mesh

            where["mesh"] = init_device_mesh(
                device().type, (ranks // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        if offload is not None:
            where["offload_policy"] = offload
        for module in [*self._units(model), model]:  # innermost first: sharding replaces params
            if lazy:  # every rank replays the same values: no broadcast needed
                materialize_lazy([module], device())
            cast_floating(module, torch.float32)  # the shards are the fp32 masters
            if split:
                apply_tensor_parallel(split, module, tp_mesh)
            fully_shard(module, reshard_after_forward=reshard, mp_policy=policy, **where)
        if meta:
            initialise_meta(model, device())
        if o.buffer_dtype is not None:
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(o.buffer_dtype)
        amp = None
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
            if precision is TrainPrecision.FP16:
                # [Note: fp16 under FSDP2]: fp32 shards, fp16 compute, and
                # a loss scale whose overflow check spans every rank's shard.
                world = dist.group.WORLD
                assert world is not None
                amp = AmpStep(o.loss_scale(), device(), groups=(world,))
        # DTensor gradients: torch reduces their norm over the shards.
        step_policy = GradientStep("TorchFSDPPlugin", clip_replicated, o.max_norm, amp)
        return request.boosted(model, optimizer, module=model, step_policy=step_policy)

    def mesh(self) -> Any:
        """With ``tp_size`` > 1: the ``(dp, tp)`` device mesh, tp innermost
        (collective the first time: every rank calls it)."""
        if self._tp_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            ranks = dist.get_world_size()
            self.validate_later(world=ranks)
            tp = self.options.tp_size
            self._tp_mesh = init_device_mesh(
                device().type, (ranks // tp, tp), mesh_dim_names=("dp", "tp")
            )
        return self._tp_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Every rank, or with ``tp_size`` > 1 the ranks at this one's place
        in each tensor-parallel group (they read different batches)."""
        if self.options.tp_size == 1:
            return super().dp_group
        group: dist.ProcessGroup = self.mesh()["dp"].get_group()
        return group

    @property
    def tp_size(self) -> int:
        return self.options.tp_size

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        if self.options.tp_size == 1:
            return None
        group: dist.ProcessGroup = self.mesh()["tp"].get_group()
        return group

    @contextmanager
    def _no_sync(self, model: Any) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]:
        return self._no_sync(model)

    def _state_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: Any = get_model_state_dict(model, options=self._state_options())
        return {k: v.detach().float().cpu().clone() for k, v in state.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, dict(state), options=self._state_options())

    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model = self.boosted(optimizer).model
        state: Any = get_optimizer_state_dict(model, optimizer, options=self._state_options())
        return {
            "state": {
                name: {
                    k: v.detach().float().cpu().clone()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                    else v
                    for k, v in entry.items()
                }
                for name, entry in state["state"].items()
            },
            "param_groups": state["param_groups"],
        }

    # The parameters and their optimizer states are DTensors, which DCP
    # saves and reshards itself.

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        return whole_state(self.boosted(model).module)

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        return own_optimizer_state(self.boosted(optimizer).module, optimizer, saved)

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        after_own_optimizer_load(self.boosted(optimizer).module, optimizer, state)

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = self.boosted(optimizer).model
        clean = without(state, "master")
        set_optimizer_state_dict(
            model,
            optimizer,
            {"state": clean["state"], "param_groups": clean["param_groups"]},
            options=self._state_options(),
        )


def _enum_name(value: Any) -> str | None:
    """An FSDP1 enum member (or its name as a string) as its name."""
    if value is None:
        return None
    name = getattr(value, "name", value)
    if not isinstance(name, str):
        raise TypeError(f"expected an enum member or its name, got {value!r}.")
    return name.upper()


def _policy_units(model: nn.Module, policy: Any) -> list[nn.Module]:
    """The units a torch-style ``auto_wrap_policy(module, recurse,
    nonwrapped_numel)`` chooses, innermost first, walked as FSDP1 walks it:
    a module whose policy says ``recurse`` has its children visited first;
    it is a unit itself when the policy says so of the parameters its
    children's units left (the root is always the last unit, so never
    chosen here)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module, root: bool) -> int:
        """Parameters under ``module`` that no unit took."""
        total = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return total
        taken = 0
        for child in module.children():
            left = visit(child, False)
            taken += sum(p.numel() for p in child.parameters()) - left
        remainder = total - taken
        if not root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
            units.append(module)
            return 0
        return remainder

    visit(model, True)
    return units
