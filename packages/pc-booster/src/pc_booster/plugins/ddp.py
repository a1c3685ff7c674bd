"""The data-parallel plugins: torch's ``DistributedDataParallel``
(:class:`TorchDDPPlugin`) and pc-comm's hfreduce-style one
(:class:`DDPPlugin`). Every rank holds the whole model and the user's own
optimizer over it, so both state conversions go by parameter name."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState
from pc_booster.clipping import clip_replicated
from pc_booster.plugin import Boosted, BoostRequest, Plugin, SupportsNoSync
from pc_booster.plugins.common import (
    cast_floating,
    clone_state,
    device,
    load_cast,
    materialize_lazy,
    require_initialized,
    torch_load_optimizer,
    torch_optimizer_state,
)
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
)
from pc_booster.step_policies import AmpStep, GradientStep

__all__ = ["DDPOptions", "DDPPlugin", "TorchDDPOptions", "TorchDDPPlugin"]


def _fp32_parameters(options: Any, setting: RunSetting) -> str | None:
    p = setting.precision
    if p in (None, TrainPrecision.FP32) or setting.model_dtype != p.dtype:
        return None
    return (
        f"keeps fp32 parameters and runs {p.value} compute through torch.autocast, but the "
        f"model was built in {p.value}, so there are no fp32 values to keep. Build the model "
        f"in fp32 (model.float()) and ask for mixed_precision='{p.value}', or use "
        f"LowLevelZeroPlugin(stage=1), which keeps fp32 masters of a {p.value} model."
    )


def _torch_ddp_arguments(options: Any, setting: RunSetting) -> str | None:
    if getattr(options, "check_reduction", False):
        return (
            "check_reduction=True: torch's DistributedDataParallel no longer uses it; "
            "find_unused_parameters=True finds parameters that got no gradient."
        )
    return None


DATA_PARALLEL_RULES = (
    Rule(
        "a model built in bf16 or fp16 (no fp32 parameters to keep)",
        _fp32_parameters,
        ({}, RunSetting(precision=TrainPrecision.BF16, model_dtype=torch.bfloat16)),
    ),
)
TORCH_DDP_RULES = (
    *DATA_PARALLEL_RULES,
    Rule(
        "check_reduction",
        _torch_ddp_arguments,
        ({"check_reduction": True}, RunSetting()),
    ),
)


# [Note: mixed precision of the data-parallel plugins]
# Booster(mixed_precision='fp16') with a data-parallel plugin is torch's
# AMP: fp32 parameters, the forward under torch.autocast, the loss scaled
# for fp16. The wrapped model's forward runs under
# autocast in the run's precision; for fp16 the returned optimizer's step
# policy (pc_booster.step_policies.AmpStep, [Note: boosted optimizer])
# multiplies the loss by a dynamic loss scale in backward, and before the
# user's optimizer steps it unscales the gradients and skips the step on an
# overflow (every rank sees the same all-reduced gradients, so every rank
# skips together); the optimizer's own step pre-hooks (clipping) then see
# unscaled gradients.


def _autocast_forward(
    forward: Any, device_type: str, dtype: torch.dtype, *args: Any, **kw: Any
) -> Any:
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kw)


class _AutocastHooks:
    """The wrapper's forward under ``torch.autocast``: entered by a forward
    pre-hook, left by an always-called forward hook (also when the forward
    raises) [Note: forward hooks, not forward assignment in pc_tensor.hooks]."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype = device_type, dtype
        self._open: list[ExitStack] = []
        module.register_forward_pre_hook(self._enter, prepend=True)
        module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        stack = ExitStack()
        stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype))
        self._open.append(stack)

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._open:
            self._open.pop().close()


def _replicated_states(psi: float, precision: TrainPrecision) -> StateBytes:
    return StateBytes(parameters=4 * psi, gradients=4 * psi, masters=0.0, optimizer=8 * psi)


@dataclass(frozen=True)
class TorchDDPOptions(PluginConfig, LossScaleOptions):
    """torch ``DistributedDataParallel``'s own options, plus ``max_norm``
    (clipping by the global norm before each step, 0 for none)."""

    name: ClassVar[str] = "torch-ddp"
    RULES: ClassVar[tuple[Rule, ...]] = TORCH_DDP_RULES

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    max_norm: float = 0.0
    check_reduction: bool = False

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        return _replicated_states(psi, precision)


@dataclass(frozen=True)
class DDPOptions(PluginConfig, LossScaleOptions):
    """pc-comm ``DistributedDataParallel``'s options, plus ``max_norm``."""

    name: ClassVar[str] = "ddp"
    RULES: ClassVar[tuple[Rule, ...]] = DATA_PARALLEL_RULES

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    max_norm: float = 0.0

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        return _replicated_states(psi, precision)


class _DataParallel(Plugin, SupportsNoSync):
    options: TorchDDPOptions | DDPOptions

    @property
    def steps_whole_tensors(self) -> bool:
        return True

    def _wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def configure(self, request: BoostRequest) -> Boosted:
        model, optimizer, precision = request.model, request.optimizer, request.precision
        require_initialized(type(self).__name__)
        materialize_lazy([model], device())
        # The wrapper broadcasts rank 0's parameters and buffers itself.
        model = model.to(device())
        # fp32 parameters; mixed precision through autocast [Note: mixed
        # precision of the data-parallel plugins]. A bf16-built model asked
        # to train in fp32 is cast up.
        cast_floating(model, torch.float32)
        wrapped = self._wrap(model)
        if precision is not TrainPrecision.FP32:
            kind = device().type
            _AutocastHooks(wrapped, kind, precision.dtype)
        amp = None
        if precision is TrainPrecision.FP16:
            amp = AmpStep(self.options.loss_scale(), device())
        policy = GradientStep(type(self).__name__, clip_replicated, self.options.max_norm, amp)
        criterion = request.criterion
        if criterion is not None and precision is not TrainPrecision.FP32:
            # A loss computed outside the model runs under the same autocast
            # (cross-entropy in fp32), as torch's AMP recipe computes it.
            criterion = partial(_autocast_forward, criterion, device().type, precision.dtype)
        return request.boosted(
            wrapped, optimizer, module=model, step_policy=policy, criterion=criterion
        )

    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]:
        context: AbstractContextManager[None] = model.no_sync()  # type: ignore[operator]
        return context

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return clone_state(self.boosted(model).module)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_cast(self.boosted(model).module, state)

    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState:
        return torch_optimizer_state(optimizer, self.boosted(optimizer).module)

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None:
        torch_load_optimizer(optimizer, self.boosted(optimizer).module, state)

    # Every rank holds everything: DCP writes each tensor once (spread over
    # the ranks) and every rank reads all of it.

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        return whole_state(self.boosted(model).module)

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        return own_optimizer_state(self.boosted(optimizer).module, optimizer, saved)

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        after_own_optimizer_load(self.boosted(optimizer).module, optimizer, state)


class TorchDDPPlugin(_DataParallel):
    """torch's ``DistributedDataParallel``; the options are its own
    (:class:`TorchDDPOptions`)."""

    OPTIONS = TorchDDPOptions

    def __init__(self, *args: Any, **fields: Any) -> None:
        """The fields of :class:`TorchDDPOptions` as keywords (or the options
        object) [Note: options declared once]."""
        super().__init__(self.options_of(args, fields))

    def _wrap(self, model: nn.Module) -> nn.Module:
        o = self.options
        assert isinstance(o, TorchDDPOptions)
        first = next(model.parameters(), None)
        ids = [first.device.index] if first is not None and first.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=ids,
            broadcast_buffers=o.broadcast_buffers,
            bucket_cap_mb=o.bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            static_graph=o.static_graph,
        )


class DDPPlugin(_DataParallel):
    """pc-comm's hfreduce-style ``DistributedDataParallel``: gradients
    reduced through host shared memory within a node, bucketed and
    overlapped with backward (:class:`DDPOptions`)."""

    OPTIONS = DDPOptions

    def __init__(self, *args: Any, **fields: Any) -> None:
        """The fields of :class:`DDPOptions` as keywords (or the options
        object) [Note: options declared once]."""
        super().__init__(self.options_of(args, fields))

    def _wrap(self, model: nn.Module) -> nn.Module:
        from pc_comm import DistributedDataParallel

        o = self.options
        assert isinstance(o, DDPOptions)
        return DistributedDataParallel(
            model,
            bucket_cap_mb=o.bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            broadcast_buffers=o.broadcast_buffers,
        )
