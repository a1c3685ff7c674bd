"""Helpers every plugin module uses: the device, start-up (lazy models
materialised, rank 0's values broadcast), state copies, clipping for the
optimizers that are the user's own, and the fp16 loss scale's settings."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import (
    CanonicalOptimizerState,
    canonical_to_torch,
    names_by_id,
    optimizer_names,
    torch_groups,
    torch_to_canonical,
    without,
)
from pc_booster.wrappers import inner_optimizer
from pc_chunk import is_lazy, materialize_
from pc_zero import ShardedOptimizer

__all__ = [
    "autocast_forward",
    "broadcast_module",
    "cast_floating_inputs",
    "clone_state",
    "device",
    "full_logits",
    "has_lazy",
    "load_cast",
    "materialize_lazy",
    "require_initialized",
    "sharded",
    "split_over_tp",
    "torch_load_optimizer",
    "torch_optimizer_state",
    "values_a_cast_rounds",
]


def device() -> torch.device:
    """Where a plugin puts the model: this rank's GPU under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_initialized(plugin: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{plugin} needs torch.distributed initialised first: run under torchrun and call "
            "pc_comm.init_distributed() (or dist.init_process_group) before building it."
        )


def sharded(optimizer: Optimizer | None) -> ShardedOptimizer:
    """The pc-zero optimizer a ZeRO plugin boosted, as the layers above see
    it, behind the optimizer ``boost`` returned (TypeError for any other
    object)."""
    optimizer = inner_optimizer(optimizer)
    if not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"expected a pc-zero optimizer, got {type(optimizer).__name__}")
    return optimizer


# -- start-up ------------------------------------------------------------------------


def _tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(tensor)
    return out


def has_lazy(module: nn.Module) -> bool:
    """Whether ``module`` was built (partly) under ``LazyInitContext``."""
    return any(is_lazy(t) for t in _tensors([module]))


def materialize_lazy(modules: Iterable[nn.Module], to: torch.device) -> None:
    """Materialise the lazy parameters and buffers of ``modules`` (only
    those: a pipeline stage materialises its own layers) on ``to``, with the
    values eager construction gives."""
    for tensor in _tensors(modules):
        if is_lazy(tensor):
            materialize_(tensor, to)


def materializer(to: torch.device) -> Callable[[nn.Module], None]:
    """:func:`materialize_lazy` of one module on ``to``, for pc-tensor's
    ``shard_model(..., materialize=...)``: a lazily built model's layers
    are materialised one at a time, as each is split."""
    return lambda module: materialize_lazy([module], to)


def split_over_tp(
    model: nn.Module, tp_group: dist.ProcessGroup, policy: Any = None, sequence_parallel: Any = None
) -> None:
    """``model`` on the device, every rank from the same values, split over
    ``tp_group`` by pc-tensor's ``shard_model`` (``policy``: None for the
    model's own plan). A lazily built model is materialised layer by layer
    as it is split, so the whole model never exists here (every rank
    replays the same values: no broadcast)."""
    from pc_tensor import shard_model

    extra: dict[str, Any] = {}
    if sequence_parallel is not None:
        extra["sequence_parallel"] = sequence_parallel
    if has_lazy(model):
        shard_model(model, tp_group, policy, materialize=materializer(device()), **extra)
        model.to(device())
        return
    materialize_lazy([model], device())
    model.to(device())
    broadcast_module(model)
    shard_model(model, tp_group, policy, **extra)


def full_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: the full vocabulary's logits of a vocabulary-split
    output layer (the loss is computed without them)."""
    from pc_tensor import gather_logits

    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output.logits = gather_logits(logits, module)
    return output


def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` starts from its first rank's parameters and buffers."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in _tensors([module]):
            dist.broadcast(tensor.data, src, group=group)


def values_a_cast_rounds(
    modules: Iterable[nn.Module], dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """The fp32 values of the trainable parameters a cast to ``dtype``
    would round (by parameter id), to initialise fp32 masters from the
    values as built rather than from their rounding [Note: model dtype]."""
    out: dict[int, torch.Tensor] = {}
    for module in modules:
        for param in module.parameters():
            narrower = (
                torch.finfo(dtype).bits < torch.finfo(param.dtype).bits
                if (param.is_floating_point())
                else False
            )
            if param.requires_grad and narrower:
                out[id(param)] = param.detach().float().clone()
    return out


def _cast_tree(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple | list):
        return type(value)(_cast_tree(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_tree(v, dtype) for k, v in value.items()}
    return value


def cast_floating_inputs(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating tensors ``module``'s forward is called with (in
    tuples, lists and dicts too) to ``dtype``, the dtype its parameters were
    cast to, through a forward pre-hook: an fp32 image batch into an fp16
    model (``cast_inputs``, docs/packages/pc-booster.md). Integer inputs
    (token ids, masks) are left as they are."""

    def hook(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _cast_tree(args, dtype), _cast_tree(kwargs, dtype)

    module.register_forward_pre_hook(hook, with_kwargs=True)


def autocast_forward(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under ``torch.autocast`` in ``dtype`` on the
    plugin's device (fp32 parameters, half compute), through a forward
    pre-hook that enters the autocast and a forward hook that leaves it,
    also when the forward raises (``always_call``)."""
    entered: list[torch.autocast] = []

    def enter(mod: nn.Module, args: Any) -> None:
        context = torch.autocast(device().type, dtype=dtype)
        context.__enter__()  # type: ignore[no-untyped-call]
        entered.append(context)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and buffers to ``dtype`` (integer buffers stay)."""
    for tensor in _tensors([module]):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)


# -- state -------------------------------------------------------------------------------


def clone_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def load_cast(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that keeps each tensor's dtype and device."""
    own = module.state_dict()
    module.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in state.items()})


def torch_optimizer_state(optimizer: Optimizer, module: nn.Module) -> CanonicalOptimizerState:
    """A plain torch optimizer's state, canonical."""
    names = optimizer_names(optimizer, names_by_id(module))
    return torch_to_canonical(optimizer.state_dict(), names)


def torch_load_optimizer(
    optimizer: Optimizer, module: nn.Module, state: CanonicalOptimizerState
) -> None:
    """Canonical state into a plain torch optimizer (no masters kept)."""
    names = optimizer_names(optimizer, names_by_id(module))
    optimizer.load_state_dict(
        canonical_to_torch(without(state, "master"), names, torch_groups(optimizer))
    )
