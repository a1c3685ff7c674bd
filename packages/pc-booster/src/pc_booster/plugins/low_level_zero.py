"""ZeRO-1 / ZeRO-2 (:class:`LowLevelZeroPlugin`) through
``pc_zero.LowLevelZeroOptimizer``, and the conversions of its state to and
from the canonical form, which the hybrid plugin shares: the fp32 masters
are the parameters' true values."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import (
    CanonicalOptimizerState,
    canonical_to_torch,
    names_by_id,
    torch_to_canonical,
)
from pc_booster.plugin import Boosted, BoostRequest, Plugin, SupportsNoSync
from pc_booster.plugins.common import (
    broadcast_module,
    cast_floating,
    cast_floating_inputs,
    clone_state,
    device,
    load_cast,
    materialize_lazy,
    require_initialized,
    sharded,
    values_a_cast_rounds,
)
from pc_booster.plugins.sharded import (
    GROUPS,
    SCALER,
    WHOLE,
    Share,
    apply_groups,
    groups_state,
    optim_key,
    restore_scalars,
    zero_model_state,
)
from pc_booster.rules import (
    EXTRA_DP_RULE,
    NVME_RULE,
    OPTIMIZER_STATES_RULE,
    LossScaleOptions,
    PluginConfig,
    Rule,
    RunSetting,
    StateBytes,
    TrainPrecision,
)
from pc_booster.step_policies import GradientStep
from pc_offload import moment_bytes, parse_state_dtype
from pc_zero import ShardedOptimizer

__all__ = [
    "LowLevelZeroOptions",
    "LowLevelZeroPlugin",
    "masters_from_built",
    "zero_load_masters",
    "zero_load_optimizer",
    "zero_masters",
    "zero_optimizer_state",
]


def _stage(options: LowLevelZeroOptions, setting: RunSetting) -> str | None:
    if options.stage not in (1, 2):
        return (
            f"stage must be 1 or 2, got {options.stage!r}; ZeRO-3 is TorchFSDPPlugin or "
            "GeminiPlugin."
        )
    return None


def zero_states(
    psi: float,
    dp: int,
    precision: TrainPrecision,
    stage: int,
    *,
    offload: bool,
    pipeline: bool,
    moment_bytes: float = 4.0,
) -> StateBytes:
    """ZeRO-1/2 model states per rank (the ZeRO paper's accounting): the
    compute-dtype parameters whole, masters and moments sharded; stage 1
    keeps the whole gradient (and, reduced in backward, its piece; a
    pipeline reduces at the step), stage 2 only its piece. Two moments of
    ``moment_bytes`` each per parameter (4 in fp32, 2 in bf16, about 1 in
    8 bits)."""
    p = precision.bytes
    m = 4 if precision is not TrainPrecision.FP32 or offload else 0
    if stage == 1:
        grads = p * psi + (0.0 if pipeline else p * psi / dp)
    elif stage == 2:
        grads = p * psi / dp
    else:  # no ZeRO: everything whole
        return StateBytes(p * psi, p * psi, m * psi, 8 * psi)
    masters, moments = m * psi / dp, 2 * moment_bytes * psi / dp
    return StateBytes(p * psi, grads, masters, moments, host=masters + moments if offload else 0.0)


@dataclass(frozen=True)
class LowLevelZeroOptions(PluginConfig, LossScaleOptions):
    """ZeRO over the data-parallel ranks.

    - ``stage``: 1 shards optimizer states, 2 gradients too.
    - ``cpu_offload``: masters, moments and the step on the host.
    - ``max_norm``: clipping by the global norm, 0 for none.
    - ``optimizer_states``: Adam's moments stored as ``"fp32"``, ``"bf16"``
      or ``"int8"`` (pc_offload [Note: low-precision optimizer states]).
    - ``nvme_offload_fraction`` / ``nvme_offload_dir`` (with
      ``cpu_offload``): that share of Adam's moments in scratch
      files on local disk (pc_offload [Note: the NVMe tier]; default
      directory: the temporary one), Colossal-AI's HybridAdam arguments.
    - ``extra_dp_size``: two-level sharding, the model sharded in this
      many groups of consecutive ranks (a node's, with torchrun's
      numbering), each replicating the others (pc_zero [Note: two-level
      sharding]); 1 shards over every rank.
    - ``initial_scale`` / ``growth_interval`` / ``hysteresis``: fp16's
      dynamic loss scale.
    """

    name: ClassVar[str] = "low-level-zero"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("stage other than 1 or 2", _stage, ({"stage": 3}, RunSetting())),
        OPTIMIZER_STATES_RULE,
        NVME_RULE,
        EXTRA_DP_RULE,
    )
    HOST_STATES_HINT: ClassVar[str] = "pass cpu_offload=True"

    stage: int = 1
    cpu_offload: bool = False
    reduce_bucket_size_in_m: float = 1.0
    overlap_communication: bool = True
    max_norm: float = 0.0
    verbose: bool = False
    # Floating inputs cast to the compute dtype (an fp32 batch into an fp16 model).
    cast_inputs: bool = True
    extra_dp_size: int = 1
    optimizer_states: str = "fp32"
    nvme_offload_fraction: float = 0.0
    nvme_offload_dir: str | None = None

    def states_on_host(self) -> bool:
        return self.cpu_offload

    def describe(self) -> str:
        extra = f" x{self.extra_dp_size}" if self.extra_dp_size > 1 else ""
        states = f" {self.optimizer_states} states" if self.optimizer_states != "fp32" else ""
        if self.nvme_offload_fraction:
            states += f" nvme {self.nvme_offload_fraction:g}"
        return f"zero{self.stage}{extra}" + (" cpu-offload" if self.cpu_offload else "") + states

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        shards = max(dp // self.extra_dp_size, 1)  # sharded inside each group
        moments = moment_bytes(parse_state_dtype(self.optimizer_states))
        states = zero_states(
            psi,
            shards,
            precision,
            self.stage,
            offload=self.cpu_offload,
            pipeline=False,
            moment_bytes=moments,
        )
        return states.on_disk(self.nvme_offload_fraction)  # nothing without cpu_offload


# -- ZeRO-1/2 state: the fp32 masters are the parameters' true values --------------


def _zero_names(optimizer: ShardedOptimizer, module: nn.Module) -> list[str | None]:
    names = names_by_id(module)
    return [names.get(id(p)) for p in optimizer.params]


def zero_masters(module: nn.Module, optimizer: ShardedOptimizer | None) -> dict[str, torch.Tensor]:
    """The fp32 masters by parameter name (collective), when they are
    separate from the parameters (fp16/bf16, offload); empty otherwise."""
    if optimizer is None or optimizer.masters_are_params:
        return {}
    names = _zero_names(optimizer, module)
    return {
        name: value
        for index, value in optimizer.full_params().items()
        if (name := names[index]) is not None
    }


def masters_from_built(
    module: nn.Module, optimizer: ShardedOptimizer, built: dict[int, torch.Tensor]
) -> None:
    """fp32 masters from the values as built (``built``, by parameter id,
    from :func:`values_a_cast_rounds`), not from their low-precision
    rounding. Collective."""
    if built and not optimizer.masters_are_params:
        names = {id(p): n for n, p in module.named_parameters()}
        zero_load_masters(module, optimizer, {names[i]: v for i, v in built.items() if i in names})


def zero_load_masters(
    module: nn.Module, optimizer: ShardedOptimizer | None, state: dict[str, torch.Tensor]
) -> None:
    """Full-precision values into the masters too (else the next step
    writes the old masters back over the loaded weights)."""
    if optimizer is None or optimizer.masters_are_params:
        return
    names = _zero_names(optimizer, module)
    optimizer.load_full_params(
        {i: state[n] for i, n in enumerate(names) if n is not None and n in state}
    )


def zero_optimizer_state(optimizer: ShardedOptimizer, module: nn.Module) -> CanonicalOptimizerState:
    full = optimizer.state_dict()
    canonical = torch_to_canonical(full, _zero_names(optimizer, module))
    canonical["loss_scaler"] = full.get("loss_scaler")
    return canonical


def zero_load_optimizer(
    optimizer: ShardedOptimizer, module: nn.Module, state: CanonicalOptimizerState
) -> None:
    groups = [
        (list(indices), {k: v for k, v in group.items() if k != "params"})
        for indices, group in zip(optimizer.group_indices, optimizer.param_groups, strict=True)
    ]
    converted = canonical_to_torch(state, _zero_names(optimizer, module), groups)
    if not optimizer.masters_are_params and not any(
        "master" in e for e in converted["state"].values()
    ):
        # A checkpoint without masters (from an fp32 plugin): keep the
        # full-precision masters the model load set, rather than letting the
        # optimizer re-derive them from the rounded parameters.
        for index, value in optimizer.full_params().items():
            if index in converted["state"]:
                converted["state"][index]["master"] = value
    if state.get("loss_scaler") is not None:
        converted["loss_scaler"] = state["loss_scaler"]
    optimizer.load_state_dict(converted)


def zero_sharded_model_state(
    module: nn.Module, optimizer: ShardedOptimizer, share: Share = WHOLE
) -> dict[str, Any]:
    """The masters' pieces this rank owns [Note: sharded canonical state],
    of the tensors ``share`` holds, placed where ``share`` says."""
    names = _zero_names(optimizer, module)
    shapes = {
        name: param.shape
        for name, param in zip(names, optimizer.params, strict=True)
        if name is not None and param.requires_grad
    }
    pieces = [
        (name, piece.start, piece.master)
        for piece in optimizer.owned_pieces()
        if (name := names[piece.param_index]) is not None
    ]
    return zero_model_state(module, shapes, pieces, share)


def zero_sharded_optimizer_state(
    module: nn.Module,
    optimizer: ShardedOptimizer,
    saved: dict[str, dict[str, bool]] | None,
    share: Share = WHOLE,
) -> dict[str, Any]:
    """The optimizer states' pieces this rank owns (of the parameters
    ``share`` holds, placed where it says), its scalars, the groups and
    the loss scale. Loading into an optimizer that has not stepped yet
    first gives it the checkpoint's state keys."""
    from pc_zero import Pieces

    names = _zero_names(optimizer, module)
    if saved:
        kinds = {k: e for keys in saved.values() for k, e in keys.items()}
        optimizer.init_state(
            [k for k, e in kinds.items() if e],
            {k: torch.zeros((), dtype=torch.float32) for k, e in kinds.items() if not e},
        )
    out: dict[str, Any] = {}
    for piece in optimizer.owned_pieces():
        name = names[piece.param_index]
        if name is None or not share.holds(name):
            continue
        shape = optimizer.params[piece.param_index].shape
        for key, view in piece.state.items():
            target = out.get(optim_key(name, key))
            if not isinstance(target, Pieces):
                target = out[optim_key(name, key)] = share.pieces(name, shape)
            share.add_range(target, name, shape, piece.start, view)
        for key, value in piece.entry.items():
            if key not in piece.state:
                out[optim_key(name, key)] = torch.as_tensor(value, dtype=torch.float32).clone()
    out[GROUPS] = zero_groups_state(module, optimizer)
    scaler = optimizer.scaler
    if scaler is not None:
        out[SCALER] = scaler.state_dict()
    return out


def zero_groups_state(module: nn.Module, optimizer: ShardedOptimizer) -> list[dict[str, Any]]:
    """The ZeRO optimizer's groups with their model parameters by name (its
    param groups hold master pieces)."""
    return groups_state(optimizer, names_by_id(module), _zero_members(optimizer))


def _zero_members(optimizer: ShardedOptimizer) -> list[list[torch.Tensor]]:
    """Each group's model parameters."""
    return [[optimizer.params[i] for i in group] for group in optimizer.group_indices]


def zero_after_sharded_optimizer_load(
    module: nn.Module, optimizer: ShardedOptimizer, state: dict[str, Any]
) -> None:
    """The scalars (shared by a bucket's parameters), groups and loss
    scale a sharded load read."""
    names = _zero_names(optimizer, module)
    for piece in optimizer.owned_pieces():
        name = names[piece.param_index]
        if name is not None:
            restore_scalars(piece.entry, state, name)
    apply_groups(optimizer, names_by_id(module), state.get(GROUPS), _zero_members(optimizer))
    scaler = optimizer.scaler
    if scaler is not None and isinstance(state.get(SCALER), dict):
        scaler.load_state_dict(state[SCALER])


class LowLevelZeroPlugin(Plugin, SupportsNoSync):
    """ZeRO-1 (optimizer states sharded) or ZeRO-2 (gradients too) through
    ``pc_zero.LowLevelZeroOptimizer``; fp16 (dynamic loss scale) and bf16
    keep fp32 masters (:class:`LowLevelZeroOptions`)."""

    options: LowLevelZeroOptions

    takes_precision = True

    OPTIONS = LowLevelZeroOptions
    POSITIONAL = ("stage",)

    def __init__(self, *args: Any, precision: str | None = None, **fields: Any) -> None:
        """``LowLevelZeroPlugin(stage=2, ...)``: the fields of
        :class:`LowLevelZeroOptions` (or the options object), and
        ``precision=`` [Note: options declared once]."""
        super().__init__(self.options_of(args, fields))
        self.set_precision(precision)

    @property
    def stage(self) -> int:
        return self.options.stage

    def configure(self, request: BoostRequest) -> Boosted:
        from pc_zero import LowLevelZeroOptimizer

        model, optimizer, precision = request.model, request.optimizer, request.precision
        require_initialized("LowLevelZeroPlugin")
        if optimizer is None:
            raise ValueError("LowLevelZeroPlugin shards an optimizer: pass one to boost().")
        o = self.options
        materialize_lazy([model], device())
        model = model.to(device())
        broadcast_module(model)
        built = values_a_cast_rounds([model], precision.dtype)
        cast_floating(model, precision.dtype)
        groups: dict[str, Any] = {}
        if o.extra_dp_size > 1:  # [Note: two-level sharding] in pc_zero
            self.validate_later(world=dist.get_world_size())
            from pc_comm import two_level_groups

            shard, replica = two_level_groups(o.extra_dp_size)
            groups = {"dp_process_group": shard, "replica_process_group": replica}
        zero = LowLevelZeroOptimizer(
            optimizer,
            **groups,
            stage=o.stage,
            cpu_offload=o.cpu_offload,
            reduce_bucket_size=int(o.reduce_bucket_size_in_m * 1024 * 1024),
            overlap_communication=o.overlap_communication,
            max_norm=o.max_norm,
            loss_scale=o.loss_scale(),
            optimizer_states=o.optimizer_states,
            nvme_offload_fraction=o.nvme_offload_fraction,
            nvme_offload_dir=o.nvme_offload_dir,
        )
        masters_from_built(model, zero, built)
        if o.cast_inputs and precision is not TrainPrecision.FP32:
            cast_floating_inputs(model, precision.dtype)
        if o.verbose and dist.get_rank() == 0:
            total = sum(p.numel() for p in model.parameters() if p.requires_grad)
            world = dist.get_world_size()
            print(
                f"pc: LowLevelZeroPlugin ZeRO-{o.stage} over {world} ranks, {precision.value}: "
                f"{total:,} trainable parameters in {len(zero.buckets)} buckets of at most "
                f"{o.reduce_bucket_size_in_m:g} M elements; each rank steps about "
                f"{-(-total // world):,} of them"
                + (", its masters and moments on the host" if o.cpu_offload else ""),
                flush=True,
            )
        # The gradients are reduced, unscaled and clipped inside the step.
        policy = GradientStep("LowLevelZeroPlugin")
        return request.boosted(model, zero, module=model, step_policy=policy)

    @contextmanager
    def _no_sync(self, optimizer: Optimizer) -> Iterator[None]:
        with sharded(optimizer).no_sync():
            yield

    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]:
        if optimizer is None:
            raise ValueError(
                "LowLevelZeroPlugin accumulates in the optimizer: pass it, "
                "booster.no_sync(model, optimizer)."
            )
        if self.stage == 2:
            # Stage 2 holds no full gradient to accumulate locally: each
            # backward reduce-scatters into the gradient shard, where
            # backwards add up. Accumulation is correct either way.
            return nullcontext()
        return self._no_sync(optimizer)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        boosted = self.boosted(model)
        masters = zero_masters(boosted.module, sharded(boosted.optimizer))
        return {**clone_state(boosted.module), **masters}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        boosted = self.boosted(model)
        load_cast(boosted.module, state)
        zero_load_masters(boosted.module, sharded(boosted.optimizer), state)

    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState:
        return zero_optimizer_state(sharded(optimizer), self.boosted(optimizer).module)

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None:
        zero_load_optimizer(sharded(optimizer), self.boosted(optimizer).module, state)

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        boosted = self.boosted(model)
        return zero_sharded_model_state(boosted.module, sharded(boosted.optimizer))

    def after_sharded_model_load(self, model: nn.Module) -> None:
        sharded(self.boosted(model).optimizer).sync_params()

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        module = self.boosted(optimizer).module
        return zero_sharded_optimizer_state(module, sharded(optimizer), saved)

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        module = self.boosted(optimizer).module
        zero_after_sharded_optimizer_load(module, sharded(optimizer), state)
