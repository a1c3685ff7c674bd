"""Colossal-AI's ``Booster`` over pc's: ``boost`` returns a
:class:`~pc_compat.colossalai.interface.ModelWrapper` for the model (as
Colossal-AI does) and pc's boosted optimizer (Colossal-AI's
``OptimizerWrapper`` methods); every method that takes the model accepts
the wrapper; ``booster.checkpoint_io`` is there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster import Booster as _PcBooster
from pc_booster.plugin import Plugin, Precision
from pc_compat.colossalai.interface import ModelWrapper
from pc_compat.surface import REFUSED

__all__ = ["Booster", "CheckpointIO"]

_NO_LORA = (
    "pc does not build LoRA adapters itself. Wrap the model with peft's "
    "get_peft_model(model, LoraConfig(...)) before boost (only the adapters then train), "
    "and save the adapters with the model's own save_pretrained."
)
REFUSED["colossalai.booster.Booster.enable_lora"] = _NO_LORA


def _core(model: Any) -> Any:
    """The plugin's model behind a :class:`ModelWrapper`."""
    return model.module if isinstance(model, ModelWrapper) else model


class Booster(_PcBooster):
    """``Booster(device=None, mixed_precision=None, plugin=None)``, Colossal-AI's
    order. ``device`` has no effect: the plugin places the model on this
    rank's accelerator (or the CPU) as Colossal-AI's plugins do."""

    def __init__(
        self,
        device: str | None = None,
        mixed_precision: Precision | str | Any = None,
        plugin: Plugin | None = None,
    ) -> None:
        if isinstance(device, Plugin):
            raise TypeError(
                f"Booster({type(device).__name__}(...)): the first argument is the device "
                "(Colossal-AI's order: device, mixed_precision, plugin); pass the plugin by "
                "name, Booster(plugin=...)."
            )
        if mixed_precision is not None and not isinstance(mixed_precision, str):
            raise TypeError(
                f"Booster(mixed_precision={mixed_precision!r}): pc takes 'fp16', 'bf16' or "
                "'fp32' (a MixedPrecision object has no counterpart); pass the string."
            )
        super().__init__(plugin=plugin, mixed_precision=mixed_precision)
        # Kept as given, for programs that read it back.
        self.device = device

    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        model, optimizer, criterion, dataloader, lr_scheduler = super().boost(
            model, optimizer, criterion, dataloader, lr_scheduler
        )
        wrapped = ModelWrapper(model, self.plugin.boosted(model).module)
        return wrapped, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(
        self, model: nn.Module | None = None, optimizer: Optimizer | None = None
    ) -> AbstractContextManager[None]:
        return super().no_sync(_core(model), optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return super().unwrap(_core(model))

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Optimizer | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        return super().execute_pipeline(
            data_iter, _core(model), criterion, optimizer, return_loss, return_outputs
        )

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int | None = 1024,
        use_safetensors: bool | None = False,
        use_async: bool = False,
    ) -> Future[None] | None:
        """pc's ``save_model`` with Colossal-AI's defaults (``size_per_shard``
        1024 MiB, which has no effect on a single file)."""
        return super().save_model(
            _core(model), checkpoint, shard, gather_dtensor, prefix,
            size_per_shard if shard else None, use_safetensors, use_async,
        )  # fmt: skip

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        super().load_model(_core(model), checkpoint, strict, low_cpu_mem_mode, num_threads)

    def export_pretrained(
        self, model: nn.Module, directory: str | os.PathLike[str], size_per_shard: int = 1024
    ) -> None:
        super().export_pretrained(_core(model), directory, size_per_shard)

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """Refused: pc does not build LoRA adapters itself."""
        raise ValueError(f"Booster.enable_lora: {_NO_LORA}")

    def save_optimizer(
        self,
        optimizer: Optimizer,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int | None = 1024,
        use_async: bool = False,
    ) -> Future[None] | None:
        """pc's ``save_optimizer`` with Colossal-AI's ``size_per_shard``
        default (no effect on a single file)."""
        return super().save_optimizer(
            optimizer, checkpoint, shard, gather_dtensor, prefix,
            size_per_shard if shard else None, use_async,
        )  # fmt: skip

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Colossal-AI's ``booster.checkpoint_io``: the same saves and loads."""
        return CheckpointIO(self)


class CheckpointIO:
    """``booster.checkpoint_io``: the Booster's saves and loads under
    Colossal-AI's ``CheckpointIO`` names."""

    def __init__(self, booster: Booster) -> None:
        # The booster whose plugin owns the state.
        self.booster = booster
        self.save_model = booster.save_model
        self.load_model = booster.load_model
        self.save_optimizer = booster.save_optimizer
        self.load_optimizer = booster.load_optimizer
        self.save_lr_scheduler = booster.save_lr_scheduler
        self.load_lr_scheduler = booster.load_lr_scheduler
