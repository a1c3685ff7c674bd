"""``Booster``: one object that wraps a model, optimizer, criterion,
dataloader and LR scheduler for a plugin's parallel strategy, runs the
backward pass the strategy needs, and saves and loads checkpoints that any
other plugin, at any world size and tp / pp layout, can load (the forms are
:mod:`pc_booster.checkpoint`'s, which the checkpoint methods call).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.checkpoint import CheckpointIO
from pc_booster.plugin import Plugin, Precision, SupportsNoSync, SupportsPipeline
from pc_booster.rules import TrainPrecision
from pc_booster.step_policies import GradientStep
from pc_booster.wrappers import BoostedOptimizer, inner_optimizer

__all__ = ["Booster"]

Path = str | os.PathLike[str]


class Booster:
    """``Booster(plugin=..., mixed_precision="fp16" | "bf16" | None)``.

    The default plugin is :class:`~pc_booster.TorchDDPPlugin`.
    ``mixed_precision`` is implemented by the plugin: ZeRO and Gemini keep
    fp32 masters (fp16 with a dynamic loss scale), FSDP casts parameters in
    forward; a plugin that cannot do the asked precision refuses it here.
    Left None, a run trains in the dtype its model was built in
    (``pc_booster.rules``' [Note: model dtype]).
    """

    def __init__(
        self, plugin: Plugin | None = None, mixed_precision: Precision | str = None
    ) -> None:
        # The precision asked for, parsed once here (None: the plugin's, else the model's).
        self.precision = (
            TrainPrecision.parse(mixed_precision, "mixed_precision")
            if mixed_precision is not None
            else None
        )
        if plugin is None:
            from pc_booster.plugins import TorchDDPPlugin

            plugin = TorchDDPPlugin()
        if not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a pc_booster Plugin, got {type(plugin).__name__}.")
        if self.precision is not None:  # the plugin's rules, at construction
            plugin.validate_later(precision=self.precision)
        self.plugin = plugin
        self.mixed_precision: Precision | str = mixed_precision
        # Checkpoints: pc_booster.checkpoint, which these methods call.
        self.checkpoints = CheckpointIO(plugin)

    # -- training --------------------------------------------------------------

    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        """Wrap the objects for the plugin. Use what it returns from here on:
        plugins that shard parameters rebuild the optimizer over the shards
        (same class, hyperparameters and param groups), and the LR
        scheduler is re-pointed at it."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"boost() takes an nn.Module, got {type(model).__name__}.")
        boosted = self.plugin.boost(
            model, optimizer, criterion, dataloader, lr_scheduler, self.precision
        )
        wrapped = None
        if boosted.optimizer is not None:
            # None: the plugin's optimizer scales and clips in its own step.
            policy = boosted.step_policy or GradientStep(type(self.plugin).__name__)
            wrapped = BoostedOptimizer(boosted.optimizer, self.plugin, policy)
        # A scheduler built over the user's optimizer keeps it where that is
        # the optimizer that steps (its step patch then counts every applied
        # step); over one a plugin rebuilt, it is re-pointed at the wrapper,
        # whose param groups are the rebuilt optimizer's.
        if (
            lr_scheduler is not None
            and wrapped is not None
            and getattr(lr_scheduler, "optimizer", None) is not boosted.optimizer
        ):
            lr_scheduler.optimizer = wrapped
        return (
            boosted.model,
            wrapped,
            boosted.criterion,
            boosted.dataloader,
            boosted.lr_scheduler,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model as it was built, behind what ``boost`` returned
        (tensor-parallel layers stay split, FSDP2 parameters stay DTensors:
        the module, not a gathered copy)."""
        return self.plugin.boosted(model).module

    def backward(self, loss: torch.Tensor, optimizer: Optimizer) -> None:
        """``loss.backward()`` as the plugin needs it (loss scaling)."""
        if isinstance(optimizer, BoostedOptimizer):
            optimizer.backward(loss)
        else:
            self.plugin.backward(loss, optimizer)

    def no_sync(
        self, model: nn.Module | None = None, optimizer: Optimizer | None = None
    ) -> AbstractContextManager[None]:
        """Accumulate gradients without synchronising them."""
        if not isinstance(self.plugin, SupportsNoSync):
            raise ValueError(f"{type(self.plugin).__name__} does not support no_sync.")
        return self.plugin.no_sync(model, inner_optimizer(optimizer))  # type: ignore[arg-type]

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Optimizer | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        if not isinstance(self.plugin, SupportsPipeline):
            raise ValueError(
                f"{type(self.plugin).__name__} does not run pipelines; execute_pipeline needs "
                "a plugin with pipeline parallelism."
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, inner_optimizer(optimizer), return_loss, return_outputs
        )

    # -- checkpoints: pc_booster.checkpoint.CheckpointIO's ------------------------

    def save_model(
        self, model: nn.Module, checkpoint: Path, shard: bool = False, gather_dtensor: bool = True,
        prefix: str | None = None, size_per_shard: int | None = None,
        use_safetensors: bool | None = None, use_async: bool = False,
    ) -> Future[None] | None:  # fmt: skip
        """Write the model (collective); see :meth:`.CheckpointIO.save_model`."""
        return self.checkpoints.save_model(
            model, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_safetensors,
            use_async,
        )  # fmt: skip

    def load_model(
        self, model: nn.Module, checkpoint: Path, strict: bool = True,
        low_cpu_mem_mode: bool = True, num_threads: int = 1,
    ) -> None:  # fmt: skip
        """Load any model checkpoint; see :meth:`.CheckpointIO.load_model`."""
        self.checkpoints.load_model(model, checkpoint, strict, low_cpu_mem_mode, num_threads)

    def export_pretrained(
        self, model: nn.Module, directory: Path, size_per_shard: int = 1024
    ) -> None:
        """transformers' layout, streamed; see :meth:`.CheckpointIO.export_pretrained`."""
        self.checkpoints.export_pretrained(model, directory, size_per_shard)

    def save_optimizer(
        self, optimizer: Optimizer, checkpoint: Path, shard: bool = False,
        gather_dtensor: bool = True, prefix: str | None = None, size_per_shard: int | None = None,
        use_async: bool = False,
    ) -> Future[None] | None:  # fmt: skip
        """Write the optimizer's state; see :meth:`.CheckpointIO.save_optimizer`."""
        return self.checkpoints.save_optimizer(
            optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def load_optimizer(
        self, optimizer: Optimizer, checkpoint: Path, low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:  # fmt: skip
        """Load an optimizer checkpoint; see :meth:`.CheckpointIO.load_optimizer`."""
        self.checkpoints.load_optimizer(optimizer, checkpoint, low_cpu_mem_mode, num_threads)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: Path) -> None:
        self.checkpoints.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: Path) -> None:
        self.checkpoints.load_lr_scheduler(lr_scheduler, checkpoint)

    def wait_for_copies(self) -> None:
        """Wait for the host copies of every async save asked for so far."""
        self.checkpoints.saves.wait_for_copies()

    @property
    def async_save_waits(self) -> float:
        """Seconds optimizer steps have waited for async saves' host copies."""
        return self.checkpoints.saves.async_save_waits

    def wait_for_saves(self) -> None:
        """Wait until every async save is written; raise the first failure."""
        self.checkpoints.saves.wait_for_saves()
