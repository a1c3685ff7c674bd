"""The plugins: each assembles layers below (torch DDP / FSDP2, pc-comm's
DDP, pc-zero's ZeRO-1/2 and Gemini, pc-tensor's sharding) and converts its
state to and from the canonical form (:mod:`pc_booster.plugin`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.plugin import (
    Boosted,
    CanonicalOptimizerState,
    Plugin,
    Precision,
    SupportsNoSync,
    SupportsPipeline,
    canonical_to_torch,
    names_by_id,
    optimizer_names,
    rebuild_optimizer,
    torch_groups,
    torch_to_canonical,
    without,
)

__all__ = [
    "DDPPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]

_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Process groups by (default group, layout), shared by the plugins of a job.
_SUBGROUPS: dict[tuple[int, int, int], Any] = {}
_TIE_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _loss_scale(initial_scale: float, growth_interval: int, hysteresis: int) -> Any:
    """The fp16 dynamic loss scale's settings (unused for fp32 and bf16)."""
    from pc_zero import LossScaleConfig

    return LossScaleConfig(
        initial_scale=initial_scale, growth_interval=growth_interval, hysteresis=hysteresis
    )


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _require_initialized(plugin: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{plugin} needs torch.distributed initialised first: run under torchrun and call "
            "pc_comm.init_distributed() (or dist.init_process_group) before building it."
        )


def _broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src, group=group)


def _clone_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def _load_cast(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that keeps each tensor's dtype and device."""
    own = module.state_dict()
    module.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in state.items()})


# -- ZeRO-1/2 state: the fp32 masters are the parameters' true values --------------


def _zero_names(optimizer: Any, module: nn.Module) -> list[str | None]:
    names = names_by_id(module)
    return [names.get(id(p)) for p in optimizer._params]


def _zero_masters(module: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The fp32 masters by parameter name (collective), when they are
    separate from the parameters (fp16/bf16, offload); empty otherwise."""
    if optimizer is None or optimizer._alias_master:
        return {}
    names = _zero_names(optimizer, module)
    return {
        name: value
        for index, value in optimizer.full_params().items()
        if (name := names[index]) is not None
    }


def _zero_model_state(module: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The model's state with each trainable parameter taken from the fp32
    masters, not from its fp16/bf16 rounding."""
    return {**_clone_state(module), **_zero_masters(module, optimizer)}


def _torch_optimizer_state(optimizer: Optimizer, module: nn.Module) -> CanonicalOptimizerState:
    """A plain torch optimizer's state, canonical."""
    names = optimizer_names(optimizer, names_by_id(module))
    return torch_to_canonical(optimizer.state_dict(), names)


def _torch_load_optimizer(
    optimizer: Optimizer, module: nn.Module, state: CanonicalOptimizerState
) -> None:
    """Canonical state into a plain torch optimizer (no masters kept)."""
    names = optimizer_names(optimizer, names_by_id(module))
    optimizer.load_state_dict(
        canonical_to_torch(without(state, "master"), names, torch_groups(optimizer))
    )


def _zero_load_masters(module: nn.Module, optimizer: Any, state: dict[str, torch.Tensor]) -> None:
    """Full-precision values into the masters too (else the next step
    writes the old masters back over the loaded weights)."""
    if optimizer is None or optimizer._alias_master:
        return
    names = _zero_names(optimizer, module)
    optimizer.load_full_params(
        {i: state[n] for i, n in enumerate(names) if n is not None and n in state}
    )


def _zero_optimizer_state(optimizer: Any, module: nn.Module) -> CanonicalOptimizerState:
    full = optimizer.state_dict()
    canonical = torch_to_canonical(full, _zero_names(optimizer, module))
    canonical["loss_scaler"] = full.get("loss_scaler")
    return canonical


def _zero_load_optimizer(optimizer: Any, module: nn.Module, state: CanonicalOptimizerState) -> None:
    groups = [
        (indices, {k: v for k, v in group.items() if k != "params"})
        for indices, group in zip(optimizer._group_indices, optimizer.param_groups, strict=True)
    ]
    converted = canonical_to_torch(state, _zero_names(optimizer, module), groups)
    if not optimizer._alias_master and not any("master" in e for e in converted["state"].values()):
        # A checkpoint without masters (from an fp32 plugin): keep the
        # full-precision masters the model load set, rather than letting the
        # optimizer re-derive them from the rounded parameters.
        for index, value in optimizer.full_params().items():
            if index in converted["state"]:
                converted["state"][index]["master"] = value
    if state.get("loss_scaler") is not None:
        converted["loss_scaler"] = state["loss_scaler"]
    optimizer.load_state_dict(converted)


class _DataParallel(Plugin, SupportsNoSync):
    """What the two DDP plugins share: the optimizer is the user's, over the
    model's own parameters, so both state conversions are by name."""

    supported_precisions: tuple[Precision, ...] = (None,)

    def _wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: Precision,
    ) -> Boosted:
        _require_initialized(type(self).__name__)
        model = model.to(_device())
        wrapped = self._wrap(model)
        return Boosted(wrapped, optimizer, criterion, dataloader, lr_scheduler, module=model)

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
        context: AbstractContextManager[None] = model.no_sync()  # type: ignore[operator]
        return context

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return _clone_state(self.boosted(model).module)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        _load_cast(self.boosted(model).module, state)

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        return _torch_optimizer_state(optimizer, self.boosted(optimizer).module)

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        _torch_load_optimizer(optimizer, self.boosted(optimizer).module, state)


class TorchDDPPlugin(_DataParallel):
    """torch's ``DistributedDataParallel``; the options are its own."""

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        self.options = {
            "broadcast_buffers": broadcast_buffers,
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }

    def _wrap(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, **self.options)  # type: ignore[arg-type]


class DDPPlugin(_DataParallel):
    """pc-comm's hfreduce-style ``DistributedDataParallel``: gradients
    reduced through host shared memory within a node, bucketed and
    overlapped with backward."""

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers

    def _wrap(self, model: nn.Module) -> nn.Module:
        from pc_comm import DistributedDataParallel

        return DistributedDataParallel(
            model,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            broadcast_buffers=self.broadcast_buffers,
        )


class LowLevelZeroPlugin(Plugin, SupportsNoSync):
    """ZeRO-1 (optimizer states sharded) or ZeRO-2 (gradients too) through
    ``pc_zero.LowLevelZeroOptimizer``; fp16 (dynamic loss scale) and bf16
    keep fp32 masters. ``max_norm``: gradient clipping, 0 for none."""

    def __init__(
        self,
        stage: int = 1,
        *,
        cpu_offload: bool = False,
        reduce_bucket_size_in_m: float = 1.0,
        overlap_communication: bool = True,
        max_norm: float = 0.0,
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        super().__init__()
        self.loss_scale = _loss_scale(initial_scale, growth_interval, hysteresis)
        if stage not in (1, 2):
            raise ValueError(
                f"LowLevelZeroPlugin: stage must be 1 or 2, got {stage}; ZeRO-3 is "
                "TorchFSDPPlugin or GeminiPlugin."
            )
        self.stage = stage
        self.cpu_offload = cpu_offload
        self.bucket = int(reduce_bucket_size_in_m * 1024 * 1024)
        self.overlap_communication = overlap_communication
        self.max_norm = max_norm

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: Precision,
    ) -> Boosted:
        from pc_zero import LowLevelZeroOptimizer

        _require_initialized("LowLevelZeroPlugin")
        if optimizer is None:
            raise ValueError("LowLevelZeroPlugin shards an optimizer: pass one to boost().")
        model = model.to(_device())
        _broadcast_module(model)
        if precision is not None:
            model.to(_DTYPES[precision])
        zero = LowLevelZeroOptimizer(
            optimizer,
            stage=self.stage,
            cpu_offload=self.cpu_offload,
            reduce_bucket_size=self.bucket,
            overlap_communication=self.overlap_communication,
            clip_grad_norm=self.max_norm,
            loss_scale=self.loss_scale,
        )
        return Boosted(model, zero, criterion, dataloader, lr_scheduler, module=model)

    @contextmanager
    def _no_sync(self, optimizer: Any) -> Iterator[None]:
        with optimizer.no_sync():
            yield

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
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
        return _zero_model_state(boosted.module, boosted.optimizer)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        boosted = self.boosted(model)
        _load_cast(boosted.module, state)
        _zero_load_masters(boosted.module, boosted.optimizer, state)

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        return _zero_optimizer_state(optimizer, self.boosted(optimizer).module)

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        _zero_load_optimizer(optimizer, self.boosted(optimizer).module, state)


class _Sharded(Plugin):
    """What the pc ZeRO-3 wrappers share (a ``pc_zero.ShardedModule``): the
    model state through summon, the optimizer state per parameter by
    placing each rank's part at its offset and summing over the group."""

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.float().cpu() for k, v in model.full_state_dict().items()}  # type: ignore[operator]

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        model.load_full_state_dict(state)  # type: ignore[operator]

    def _parts(self, optimizer: Any) -> Iterator[tuple[str, nn.Parameter, int, int, torch.Size]]:
        boosted = self.boosted(optimizer)
        names = names_by_id(boosted.module)
        wrapper: Any = boosted.model
        for chunk in wrapper.chunks:
            for slot, (param, start, part) in zip(chunk.slots, chunk.shard_parts(), strict=True):
                yield names[id(param)], param, start, part.numel(), slot.shape

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        inner = optimizer.inner if hasattr(optimizer, "inner") else optimizer
        names = names_by_id(self.boosted(optimizer).module)
        groups = {"state": {}, "param_groups": inner.state_dict()["param_groups"]}
        saved = torch_to_canonical(groups, optimizer_names(inner, names))  # groups by name
        parts = list(self._parts(optimizer))
        wrapper: Any = self.boosted(optimizer).model
        # Which keys each parameter has, and its scalars ("step"), agreed
        # first: a rank whose part is empty may hold no state at all, and
        # every rank must make the same collectives.
        mine = {
            name: {
                k: "tensor" if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in inner.state.get(param, {}).items()
            }
            for name, param, *_ in parts
        }
        everyone: list[Any] = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(everyone, mine, group=self.dp_group)
        state: dict[str, dict[str, Any]] = {}
        for name, param, start, numel, shape in parts:
            keys: dict[str, Any] = {}
            for other in everyone:
                for k, v in other[name].items():
                    keys.setdefault(k, v)
            entry = inner.state.get(param, {})
            full_entry: dict[str, Any] = {}
            for key in sorted(keys):
                if keys[key] != "tensor":
                    value = keys[key]
                    full_entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                full = torch.zeros(shape.numel(), dtype=torch.float32, device=param.device)
                if key in entry:
                    full[start : start + numel] = entry[key].float()
                wrapper.comm.all_reduce(full)
                full_entry[key] = full.view(shape).cpu()
            state[name] = full_entry
        scaler = getattr(optimizer, "scaler", None)
        return {
            "state": state,
            "param_groups": saved["param_groups"],
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
        }

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        inner = optimizer.inner if hasattr(optimizer, "inner") else optimizer
        names = names_by_id(self.boosted(optimizer).module)
        converted = canonical_to_torch(
            {"state": {}, "param_groups": state["param_groups"]},
            optimizer_names(inner, names),
            torch_groups(inner),
        )
        inner.load_state_dict(converted)  # hyperparameters
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and state.get("loss_scaler") is not None:
            scaler.load_state_dict(state["loss_scaler"])
        if hasattr(optimizer, "inner"):  # torch swapped the group objects: re-alias
            optimizer.param_groups, optimizer.state = inner.param_groups, inner.state
        for name, param, start, numel, _ in self._parts(optimizer):
            entry = state["state"].get(name)
            if entry is None:
                continue
            local: dict[str, Any] = {}
            for key, value in entry.items():
                if key == "master":
                    continue
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    part = value.reshape(-1)[start : start + numel]
                    local[key] = part.to(param.device, torch.float32).clone()
                else:
                    local[key] = value.clone() if isinstance(value, torch.Tensor) else value
            inner.state[param] = local


class GeminiPlugin(_Sharded, SupportsNoSync):
    """Chunk-based ZeRO-3 (``pc_zero.GeminiDDP`` + ``GeminiOptimizer``):
    parameters packed into chunks in execution order, each chunk gathered
    once for every parameter in it; ``placement_policy`` ``"static"`` (with
    ``offload_param_frac`` of the chunks on the host) or ``"auto"`` (within
    ``device_budget_bytes``). The optimizer is rebuilt over the shards with
    the same class, hyperparameters and param groups; use
    ``pc_offload.HybridAdam`` to step host-resident shards fast.
    ``step_in_backward=True`` steps each chunk as soon as its gradients are
    reduced (12 bytes per parameter of model states instead of 16; no
    clipping, fp16 or accumulation: see pc_zero's [Note: stepping in
    backward])."""

    def __init__(
        self,
        placement_policy: str = "static",
        *,
        offload_param_frac: float = 0.0,
        device_budget_bytes: int | None = None,
        chunk_size: int | None = None,
        search_range_m: float = 32.0,
        min_chunk_size_m: float = 32.0,
        max_norm: float = 0.0,
        prefetch: bool = True,
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        step_in_backward: bool = False,
    ) -> None:
        super().__init__()
        self.loss_scale = _loss_scale(initial_scale, growth_interval, hysteresis)
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"GeminiPlugin: placement_policy must be 'static' or 'auto', got "
                f"{placement_policy!r}."
            )
        if step_in_backward and max_norm > 0:
            raise ValueError(
                f"GeminiPlugin: step_in_backward=True steps each chunk before the others' "
                f"gradients exist, so max_norm={max_norm} cannot clip by the global norm; "
                "pass max_norm=0 or step_in_backward=False."
            )
        self.options: dict[str, Any] = {
            "placement_policy": placement_policy,
            "offload_param_frac": offload_param_frac,
            "device_budget_bytes": device_budget_bytes,
            "chunk_size": chunk_size,
            "search_range": int(search_range_m * 2**20),
            "min_chunk_size": int(min_chunk_size_m * 2**20),
            "prefetch": prefetch,
            "step_in_backward": step_in_backward,
        }
        self.max_norm = max_norm

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: Precision,
    ) -> Boosted:
        from pc_zero import GeminiDDP, GeminiOptimizer

        _require_initialized("GeminiPlugin")
        if optimizer is None:
            raise ValueError("GeminiPlugin shards an optimizer: pass one to boost().")
        names = names_by_id(model)
        dtype = _DTYPES[precision] if precision is not None else torch.float32
        with torch.no_grad():  # frozen parameters stay whole on every rank, in the compute dtype
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(dtype)
        wrapped = GeminiDDP(
            model, device=_device(), mixed_precision=dtype, sync_module_states=True, **self.options
        )
        # Chunks hold trainable parameters only; frozen ones leave the optimizer.
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        inner = rebuild_optimizer(optimizer, names, trainable, skip_missing=True)
        zero = GeminiOptimizer(inner, wrapped, max_norm=self.max_norm, loss_scale=self.loss_scale)
        return Boosted(wrapped, zero, criterion, dataloader, lr_scheduler, module=model)

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
        # No rank holds a full gradient to accumulate locally: each backward
        # reduce-scatters into the gradient shard, where backwards add up.
        # Accumulation is correct inside or outside this context.
        if self.options["step_in_backward"]:
            raise ValueError(
                "GeminiPlugin(step_in_backward=True) steps in every backward, so gradients "
                "cannot accumulate over micro-batches: use step_in_backward=False for "
                "accumulation, or one backward per step."
            )
        return nullcontext()


class TorchFSDPPlugin(Plugin, SupportsNoSync):
    """torch's FSDP2 (``fully_shard``) on every transformer block (the
    model's ``_no_split_modules`` for ``transformers`` models, or
    ``wrap_classes``) and the root. The optimizer is rebuilt over the
    sharded DTensor parameters with the same class, hyperparameters and
    param groups; checkpoints go through ``torch.distributed.checkpoint``'s
    full state dicts, keyed by parameter name."""

    supported_precisions: tuple[Precision, ...] = (None, "bf16")

    def __init__(
        self,
        reshard_after_forward: bool = True,
        wrap_classes: tuple[type[nn.Module], ...] | None = None,
    ) -> None:
        super().__init__()
        self.reshard_after_forward = reshard_after_forward
        self.wrap_classes = wrap_classes

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: Precision,
    ) -> Boosted:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _require_initialized("TorchFSDPPlugin")
        names = names_by_id(model)
        model = model.to(_device())
        _broadcast_module(model)
        policy = MixedPrecisionPolicy(
            param_dtype=_DTYPES[precision] if precision is not None else None,
            reduce_dtype=torch.float32,
        )
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        # A parameter tied across modules (BERT's embedding and decoder)
        # must sit in one FSDP group: a module holding one whose other
        # owner is outside it stays with the root.
        owners: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), []).append(name)
        units: list[nn.Module] = []
        for prefix, module in list(model.named_modules())[1:]:
            chosen = (
                isinstance(module, self.wrap_classes)
                if self.wrap_classes is not None
                else type(module).__name__ in blocks
            )
            tied_outside = any(
                not n.startswith(prefix + ".") for p in module.parameters() for n in owners[id(p)]
            )
            if chosen and not tied_outside:
                units.append(module)
        for module in units:  # chosen first: sharding replaces the parameters
            fully_shard(module, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
        return Boosted(model, optimizer, criterion, dataloader, lr_scheduler, module=model)

    @contextmanager
    def _no_sync(self, model: Any) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
        return self._no_sync(model)

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: Any = get_model_state_dict(model, options=self._options())
        return {k: v.detach().float().cpu().clone() for k, v in state.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, dict(state), options=self._options())

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model = self.boosted(optimizer).model
        state: Any = get_optimizer_state_dict(model, optimizer, options=self._options())
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

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = self.boosted(optimizer).model
        clean = without(state, "master")
        set_optimizer_state_dict(
            model,
            optimizer,
            {"state": clean["state"], "param_groups": clean["param_groups"]},
            options=self._options(),
        )


class HybridParallelPlugin(Plugin, SupportsNoSync, SupportsPipeline):
    """Tensor parallelism (pc-tensor's ``shard_model``, optionally with
    sequence parallelism) x data parallelism (pc-comm's DDP, or ZeRO-1/2
    over the data-parallel ranks with clipping across the tensor-parallel
    shards). Ranks are laid out tp innermost (``pc_comm.make_subgroups``)."""

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        *,
        zero_stage: int = 0,
        num_microbatches: int | None = None,
        pp_style: str = "1f1b",
        enable_sequence_parallelism: bool = False,
        max_norm: float = 0.0,
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        pp_timeout: float = 300.0,
    ) -> None:
        super().__init__()
        self.loss_scale = _loss_scale(initial_scale, growth_interval, hysteresis)
        if not pp_timeout > 0:
            raise ValueError(
                f"HybridParallelPlugin: pp_timeout must be positive, got {pp_timeout}."
            )
        self.pp_timeout = pp_timeout  # seconds a stage waits for a neighbour's tensor
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"HybridParallelPlugin: {name} must be an int >= 1, got {value!r}."
                )
        if zero_stage not in (0, 1, 2):
            raise ValueError(
                f"HybridParallelPlugin: zero_stage must be 0, 1 or 2, got {zero_stage}."
            )
        if pp_style not in ("1f1b", "interleaved", "zbv"):
            raise ValueError(
                f"HybridParallelPlugin: pp_style must be '1f1b', 'interleaved' or 'zbv', got "
                f"{pp_style!r}."
            )
        if zero_stage == 2 and pp_size > 1:
            raise ValueError(
                "HybridParallelPlugin: ZeRO-2 shards gradients, which every micro-batch's "
                "backward of a pipeline would have to reduce; use zero_stage=1 with "
                f"pp_size={pp_size}."
            )
        if enable_sequence_parallelism and tp_size == 1:
            raise ValueError(
                "HybridParallelPlugin: sequence parallelism splits the sequence over the "
                "tensor-parallel ranks; set tp_size > 1 or enable_sequence_parallelism=False."
            )
        if pp_size > 1 and enable_sequence_parallelism:
            raise ValueError(
                "HybridParallelPlugin: sequence parallelism with pipelines is not supported "
                "yet (the stages would pass sequence slices); set one of them off."
            )
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(
                f"HybridParallelPlugin: num_microbatches must be >= 1, got {num_microbatches}."
            )
        if max_norm and zero_stage == 0 and tp_size > 1:
            raise ValueError(
                "HybridParallelPlugin: gradient clipping across tensor-parallel shards is done "
                "by the ZeRO optimizer; set zero_stage=1 (or max_norm=0)."
            )
        self.tp_size, self.pp_size, self.zero_stage = tp_size, pp_size, zero_stage
        self.num_microbatches, self.pp_style = num_microbatches, pp_style
        self.sequence_parallel = enable_sequence_parallelism
        self.max_norm = max_norm
        self._groups: Any = None
        if dist.is_initialized():
            self._check_world()

    @property
    def supported_precisions(self) -> tuple[Precision, ...]:  # type: ignore[override]
        return (None, "fp16", "bf16") if self.zero_stage else (None,)

    def _check_world(self) -> None:
        world = dist.get_world_size()
        if world % (self.tp_size * self.pp_size):
            raise ValueError(
                f"HybridParallelPlugin: tp_size ({self.tp_size}) x pp_size ({self.pp_size}) = "
                f"{self.tp_size * self.pp_size} does not divide the world size ({world}); the "
                f"data-parallel size would be {world / (self.tp_size * self.pp_size):.3g}. "
                "Choose sizes whose product divides the number of processes."
            )

    @property
    def groups(self) -> Any:
        if self._groups is None:
            from pc_comm import make_subgroups

            _require_initialized("HybridParallelPlugin")
            self._check_world()
            # Creating process groups is a collective over the whole job and
            # not cheap: plugins of one layout share them.
            key = (id(dist.group.WORLD), self.pp_size, self.tp_size)
            if key not in _SUBGROUPS:
                _SUBGROUPS[key] = make_subgroups(pp_size=self.pp_size, tp_size=self.tp_size)
            self._groups = _SUBGROUPS[key]
        return self._groups

    @property
    def dp_group(self) -> dist.ProcessGroup:
        group: dist.ProcessGroup = self.groups.dp
        return group

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: Precision,
    ) -> Boosted:
        from pc_comm import DistributedDataParallel
        from pc_tensor import shard_model

        groups = self.groups
        names = names_by_id(model)
        model = model.to(_device())
        _broadcast_module(model)
        if self.tp_size > 1:
            shard_model(model, groups.tp, sequence_parallel=self.sequence_parallel)
        if precision is not None:
            model.to(_DTYPES[precision])
        dp = dist.get_world_size(groups.dp)
        if self.pp_size > 1:
            return self._configure_pipeline(
                model, names, optimizer, criterion, dataloader, lr_scheduler
            )
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
        wrapped: nn.Module = model
        if self.zero_stage:
            if optimizer is None:
                raise ValueError("zero_stage > 0 shards an optimizer: pass one to boost().")
            optimizer = self._zero(optimizer)
        elif dp > 1:
            wrapped = DistributedDataParallel(model, process_group=groups.dp)
        return Boosted(wrapped, optimizer, criterion, dataloader, lr_scheduler, module=model)

    # -- pipelines ---------------------------------------------------------------

    def _configure_pipeline(
        self,
        model: nn.Module,
        names: dict[int, str],
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
    ) -> Boosted:
        from pc_booster.pipeline import pipeline_layers
        from pc_comm import DistributedDataParallel
        from pc_pipeline import Interleaved1F1B, PipeDream, Sequential, ZeroBubble, partition

        groups = self.groups
        layers, self._loss_kind = pipeline_layers(model)
        chunks_per_rank = 2 if self.pp_style == "interleaved" else 1
        stages = self.pp_size * chunks_per_rank
        blocks = len(layers) - 2
        if blocks % stages:
            raise ValueError(
                f"HybridParallelPlugin: {blocks} transformer blocks do not split evenly into "
                f"{stages} pipeline stages (pp_size={self.pp_size}"
                f"{', 2 chunks per rank' if chunks_per_rank > 1 else ''}); choose a pp_size "
                "that divides the number of layers."
            )
        balance = [blocks // stages] * stages
        balance[0] += 1  # the embedding
        balance[-1] += 1  # the head
        sequence = Sequential(*layers)
        pp_rank, pp = dist.get_rank(groups.pp), self.pp_size

        def stage_modules(rank: int) -> list[nn.Module]:
            part = partition(sequence, rank, pp, chunks_per_rank, balance=balance)
            return list(part) if isinstance(part, list) else [part]

        holders: dict[int, list[int]] = {}  # parameter id -> pp ranks holding it
        for rank in range(pp):
            for module in stage_modules(rank):
                for param in module.parameters():
                    if rank not in holders.setdefault(id(param), []):
                        holders[id(param)].append(rank)
        by_name = dict(model.named_parameters())
        self._owner = {  # every alias of a tied weight too (BERT's decoder bias)
            n: holders[id(p)][0]
            for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) in holders
        }
        mine = stage_modules(pp_rank)
        own = {n: p for n, p in by_name.items() if pp_rank in holders.get(id(p), [])}
        self._tied = self._tie_groups(holders, by_name, pp_rank)

        dp = dist.get_world_size(groups.dp)
        if not self.zero_stage and dp > 1:
            # Buffers are synchronised once, here: re-broadcasting them every
            # micro-batch would overwrite tensors earlier micro-batches'
            # graphs still hold (BERT's token_type_ids).
            mine = [
                DistributedDataParallel(m, process_group=groups.dp, broadcast_buffers=False)
                for m in mine
            ]
        chunks = self.num_microbatches or pp
        wait = self.pp_timeout
        if self.pp_style == "interleaved":
            pipe: nn.Module = Interleaved1F1B(mine, chunks, groups.pp, timeout=wait)
        elif self.pp_style == "zbv":
            pipe = ZeroBubble(mine[0], chunks, groups.pp, timeout=wait)
        else:
            pipe = PipeDream(mine[0], chunks, groups.pp, timeout=wait)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, own, skip_missing=True)
            if self.zero_stage:
                optimizer = self._zero(optimizer)
        return Boosted(pipe, optimizer, criterion, dataloader, lr_scheduler, module=model)

    def _zero(self, optimizer: Optimizer) -> Any:
        """ZeRO over the data-parallel ranks, clipping across the tp shards."""
        from pc_zero import LowLevelZeroOptimizer

        return LowLevelZeroOptimizer(
            optimizer,
            stage=self.zero_stage,
            dp_process_group=self.groups.dp,
            tp_process_group=self.groups.tp if self.tp_size > 1 else None,
            clip_grad_norm=self.max_norm,
            loss_scale=self.loss_scale,
        )

    def _tie_groups(
        self, holders: dict[int, list[int]], by_name: dict[str, nn.Parameter], pp_rank: int
    ) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
        """Groups summing the gradients of weights held by several stages
        (an LM head tied to the embedding): one group per tie and per
        data/tensor-parallel position, created by every rank in one order."""
        dims = self.groups.dims
        ties = sorted({tuple(r) for r in holders.values() if len(r) > 1})
        out: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        me = self.groups.coord
        for tie in ties:
            for d in range(dims.dp):
                for t in range(dims.tp):
                    ranks = tuple((d * dims.pp + p) * dims.tp + t for p in tie)
                    key = (id(dist.group.WORLD), ranks)
                    if key not in _TIE_GROUPS:
                        _TIE_GROUPS[key] = dist.new_group(list(ranks))
                    group = _TIE_GROUPS[key]
                    if d == me.dp and t == me.tp and pp_rank in tie:
                        for param in by_name.values():
                            if tuple(holders.get(id(param), ())) == tie:
                                out.append((param, group))
        return out

    def _lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._loss_kind == "causal":
            logits, labels = logits[:, :-1], labels[:, 1:]
        flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if self.tp_size > 1:
            from pc_tensor import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(flat, target, self.groups.tp)
        return nn.functional.cross_entropy(flat.float(), target)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Any,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One step's forward and backward through the pipeline on the next
        batch of ``data_iter`` (a dict with ``input_ids`` and optionally
        ``labels``, or a tensor of ids). ``criterion(logits, labels)``
        defaults to the model's LM loss (vocabulary-parallel under tensor
        parallelism). Returns ``{"loss", "outputs"}``: the mean loss over
        the micro-batches on every rank, and the outputs on the last
        stage's ranks (None elsewhere). Then call ``optimizer.step()``."""
        if self.pp_size == 1:
            raise ValueError("execute_pipeline needs pp_size > 1; call the model directly.")
        batch = next(data_iter)
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        labels = batch.get("labels", ids) if isinstance(batch, dict) else ids
        loss_fn = criterion if criterion is not None else self._lm_loss
        context: AbstractContextManager[None] = (
            optimizer.no_sync() if self.zero_stage == 1 else nullcontext()
        )
        with context:
            losses, outputs = model.forward_backward(  # type: ignore[operator]
                ids, criterion=loss_fn, labels=(labels,), return_outputs=return_outputs
            )
        for param, group in self._tied:
            if self.zero_stage == 1:
                grad = optimizer.accumulated_grad(param)
            else:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            dist.all_reduce(grad, group=group)
        loss = (
            losses.detach().float().mean()
            if losses is not None
            else torch.zeros((), device=_device())
        )
        last = dist.get_global_rank(self.groups.pp, self.pp_size - 1)
        dist.broadcast(loss, last, group=self.groups.pp)
        return {"loss": loss if return_loss else None, "outputs": outputs}

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
        if self.pp_size > 1:
            return nullcontext()  # a pipeline step accumulates its micro-batches itself
        if self.zero_stage == 1 and optimizer is None:
            raise ValueError(
                "with zero_stage=1 gradients accumulate in the optimizer: pass it, "
                "booster.no_sync(model, optimizer)."
            )
        if self.zero_stage == 1:
            context: AbstractContextManager[None] = optimizer.no_sync()
            return context
        wrapped: Any = model
        if self.zero_stage == 2 or not hasattr(wrapped, "no_sync"):
            return nullcontext()  # ZeRO-2 accumulates in its shard; dp 1 has nothing to sync
        context = wrapped.no_sync()
        return context

    # -- canonical state -------------------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = self._local_model_state(model)
        if self.pp_size > 1:  # each weight from the stage that trains it
            group = self.groups.pp
            for key in sorted(state):
                owner = self._owner.get(key, 0)
                value = state[key].to(_device())
                dist.broadcast(value, dist.get_global_rank(group, owner), group=group)
                state[key] = value.cpu()
        return state

    def _local_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        boosted = self.boosted(model)
        module = boosted.module
        masters = _zero_masters(module, boosted.optimizer) if self.zero_stage else {}
        if self.tp_size == 1:
            state = _clone_state(module)
            state.update(masters)
            return state
        from pc_tensor import full_state_dict, shard_info, unshard_tensor

        state = {k: v.float().cpu() for k, v in full_state_dict(module).items()}
        info = shard_info(module)
        device = _device()  # NCCL gathers device tensors only
        for name, value in masters.items():
            spec = info.specs.get(name)
            state[name] = (
                unshard_tensor(value.to(device), spec, info.group).cpu()
                if spec is not None
                else value
            )
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        boosted = self.boosted(model)
        module = boosted.module
        if self.tp_size == 1:
            _load_cast(module, state)
            if self.zero_stage:
                _zero_load_masters(module, boosted.optimizer, state)
            return
        from pc_tensor import load_full_state_dict, shard_info, shard_tensor

        load_full_state_dict(module, state)
        if self.zero_stage and boosted.optimizer is not None:
            info = shard_info(module)
            local = dict(module.named_parameters())
            pieces = {
                name: shard_tensor(value, info.specs[name], info.group, local[name].shape)
                if name in info.specs
                else value
                for name, value in state.items()
                if name in local
            }
            _zero_load_masters(module, boosted.optimizer, pieces)

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        module = self.boosted(optimizer).module
        if self.zero_stage:
            canonical = _zero_optimizer_state(optimizer, module)
        else:
            canonical = _torch_optimizer_state(optimizer, module)
        if self.tp_size > 1:
            from pc_tensor import shard_info, unshard_tensor

            info = shard_info(module)
            device = _device()  # NCCL gathers device tensors only
            for name, entry in canonical["state"].items():
                spec = info.specs.get(name)
                if spec is None:
                    continue
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        entry[key] = unshard_tensor(value.to(device), spec, info.group).cpu()
        if self.pp_size > 1:  # every stage's part, on every rank
            parts: list[Any] = [None] * self.pp_size
            dist.all_gather_object(parts, canonical, group=self.groups.pp)
            merged: dict[str, Any] = {}
            for part in parts:
                merged.update(part["state"])
            groups = [
                {**g, "params": [n for part in parts for n in part["param_groups"][i]["params"]]}
                for i, g in enumerate(canonical["param_groups"])
            ]
            canonical = {**canonical, "state": merged, "param_groups": groups}
        return canonical

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        module = self.boosted(optimizer).module
        if self.pp_size > 1:  # this stage's parameters only
            by_id = names_by_id(module)
            params = (
                optimizer._params
                if self.zero_stage
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
        if self.tp_size > 1:
            from pc_tensor import shard_info, shard_tensor

            info = shard_info(module)
            local = dict(module.named_parameters())
            entries = {}
            for name, entry in state["state"].items():
                spec = info.specs.get(name)
                entries[name] = {
                    k: shard_tensor(v, spec, info.group, local[name].shape)
                    if spec is not None and isinstance(v, torch.Tensor) and v.dim() > 0
                    else v
                    for k, v in entry.items()
                }
            state = {**state, "state": entries}
        if self.zero_stage:
            _zero_load_optimizer(optimizer, module, state)
        else:
            _torch_load_optimizer(optimizer, module, state)
