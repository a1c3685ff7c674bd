"""torch's FSDP2 (:class:`TorchFSDPPlugin`): ``fully_shard`` on every
transformer block and the root, fp32 shards with an optional bf16 compute
dtype, the optimizer rebuilt over the DTensor shards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.plugin import (
    Boosted,
    CanonicalOptimizerState,
    Plugin,
    SupportsNoSync,
    names_by_id,
    rebuild_optimizer,
    without,
)
from pc_booster.plugins.common import (
    broadcast_module,
    cast_floating,
    clip_hook,
    clip_replicated,
    device,
    has_lazy,
    materialize_lazy,
    require_initialized,
)
from pc_booster.plugins.sharded import (
    after_own_optimizer_load,
    own_optimizer_state,
    whole_state,
)
from pc_booster.rules import PluginConfig, Rule, RunSetting, StateBytes, TrainPrecision

__all__ = ["TorchFSDPOptions", "TorchFSDPPlugin"]


def _no_fp16(options: Any, setting: RunSetting) -> str | None:
    if setting.precision is not TrainPrecision.FP16:
        return None
    return (
        "fp16 needs a loss scale, which FSDP2 does not keep; use mixed_precision='bf16' "
        "(same memory, no scale needed) or GeminiPlugin / LowLevelZeroPlugin for fp16."
    )


@dataclass(frozen=True)
class TorchFSDPOptions(PluginConfig):
    """``reshard_after_forward`` is FSDP2's; ``wrap_classes``: the module
    classes each sharded as a unit (default: a ``transformers`` model's
    ``_no_split_modules``); ``max_norm``: clipping by the global norm."""

    name: ClassVar[str] = "torch-fsdp"
    gathers_parameters: ClassVar[bool] = True
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("fp16", _no_fp16, ({}, RunSetting(precision=TrainPrecision.FP16))),
    )

    reshard_after_forward: bool = True
    wrap_classes: tuple[type[nn.Module], ...] | None = None
    max_norm: float = 0.0

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        # fp32 shards of parameters, gradients and moments; the compute
        # dtype exists only while a unit is gathered.
        return StateBytes(4 * psi / dp, 4 * psi / dp, 0.0, 8 * psi / dp)

    def build(self) -> TorchFSDPPlugin:
        return TorchFSDPPlugin(**self.as_dict())


class TorchFSDPPlugin(Plugin, SupportsNoSync):
    """torch's FSDP2 (``fully_shard``) on every transformer block (the
    model's ``_no_split_modules`` for ``transformers`` models, or
    ``wrap_classes``) and the root. A lazily built model is materialised one
    unit at a time, each sharded at once. The optimizer is rebuilt over the
    sharded DTensor parameters with the same class, hyperparameters and
    param groups; the canonical state goes through
    ``torch.distributed.checkpoint``'s state-dict functions."""

    options: TorchFSDPOptions

    def __init__(
        self,
        reshard_after_forward: bool = True,
        wrap_classes: tuple[type[nn.Module], ...] | None = None,
        max_norm: float = 0.0,
    ) -> None:
        super().__init__(
            TorchFSDPOptions(
                reshard_after_forward=reshard_after_forward,
                wrap_classes=wrap_classes,
                max_norm=max_norm,
            )
        )

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
        units: list[nn.Module] = []
        for prefix, module in list(model.named_modules())[1:]:
            chosen = (
                isinstance(module, wrap) if wrap is not None else type(module).__name__ in blocks
            )
            tied_outside = any(
                not n.startswith(prefix + ".") for p in module.parameters() for n in owners[id(p)]
            )
            if chosen and not tied_outside:
                units.append(module)
        return units

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: TrainPrecision,
    ) -> Boosted:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        require_initialized("TorchFSDPPlugin")
        names = names_by_id(model)
        lazy = has_lazy(model)
        if not lazy:
            model = model.to(device())
            broadcast_module(model)
        policy = MixedPrecisionPolicy(
            param_dtype=precision.dtype if precision is not TrainPrecision.FP32 else None,
            reduce_dtype=torch.float32,
        )
        reshard = self.options.reshard_after_forward
        for module in [*self._units(model), model]:  # innermost first: sharding replaces params
            if lazy:  # every rank replays the same values: no broadcast needed
                materialize_lazy([module], device())
            cast_floating(module, torch.float32)  # the shards are the fp32 masters
            fully_shard(module, reshard_after_forward=reshard, mp_policy=policy)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
            if self.options.max_norm > 0:
                optimizer.register_step_pre_hook(clip_hook(self.options.max_norm, clip_replicated))
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

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
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
        self, optimizer: Any, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        return own_optimizer_state(self.boosted(optimizer).module, optimizer, saved)

    def after_sharded_optimizer_load(self, optimizer: Any, state: dict[str, Any]) -> None:
        after_own_optimizer_load(self.boosted(optimizer).module, optimizer, state)

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = self.boosted(optimizer).model
        clean = without(state, "master")
        set_optimizer_state_dict(
            model,
            optimizer,
            {"state": clean["state"], "param_groups": clean["param_groups"]},
            options=self._state_options(),
        )
