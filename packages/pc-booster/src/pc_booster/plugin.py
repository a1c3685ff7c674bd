"""What a plugin is: a thin assembly of the layers below (no algorithm lives
here), plus the small capability interfaces the :class:`~pc_booster.Booster`
checks before it calls them.

Every plugin turns ``(model, optimizer, criterion, dataloader, lr_scheduler)``
into wrapped objects, and converts its model and optimizer state to and from
one *canonical* form, which is what makes a checkpoint saved under any plugin
at any world size load under any other:

- model: the unwrapped model's ``state_dict`` keys with full (unsharded)
  tensors;
- optimizer: ``{"state": {parameter name: {key: full tensor or scalar}},
  "param_groups": [{hyperparameters..., "params": [parameter names]}]}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from pc_booster.canonical import CanonicalOptimizerState
from pc_booster.rules import (
    LossScaleOptions,
    RunSetting,
    TrainPrecision,
    options_from_arguments,
    options_signature,
    register_plugin,
)
from pc_booster.step_policies import GradientStep
from pc_booster.wrappers import inner_optimizer

if TYPE_CHECKING:
    from pc_booster.rules import PluginConfig

__all__ = [
    "BoostRequest",
    "Boosted",
    "Plugin",
    "Precision",
    "ScalesLoss",
    "SupportsNoSync",
    "SupportsPipeline",
]

Precision = Literal["fp16", "bf16"] | None


@dataclass
class Boosted:
    """What :meth:`Plugin.configure` returns and remembers per model."""

    model: nn.Module
    optimizer: Optimizer | None
    criterion: Any
    dataloader: Any
    lr_scheduler: Any
    # The model as the user built it (unwrapped), for names and export.
    module: nn.Module
    # How the returned optimizer steps: scale, unscale, clip, skip or step
    # [Note: one step policy]; None: an optimizer that does all of it in its
    # own step (pc-zero's).
    step_policy: GradientStep | None = None


@dataclass(frozen=True)
class BoostRequest:
    """What ``boost`` was given, and the precision the run trains in, for
    :meth:`Plugin.configure`."""

    model: nn.Module
    optimizer: Optimizer | None
    criterion: Any
    dataloader: Any
    lr_scheduler: Any
    precision: TrainPrecision

    def boosted(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        module: nn.Module,
        step_policy: GradientStep | None = None,
        criterion: Any = None,
    ) -> Boosted:
        """The wrapped model and optimizer (``module``: the model as built),
        with this request's criterion (or ``criterion``), dataloader and
        LR scheduler."""
        criterion = criterion if criterion is not None else self.criterion
        return Boosted(
            model, optimizer, criterion, self.dataloader, self.lr_scheduler, module, step_policy
        )


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype the model's trainable parameters were built in."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point():
            return param.dtype
    return None


# [Note: whole-tensor optimizers]
# An optimizer class may declare ``needs_whole_tensors = True`` (a class
# attribute; pc-compat's Lamb and Lars do): its step reads a norm of each
# whole parameter, so over a ZeRO / Gemini / FSDP shard or a tensor-parallel
# piece it would compute a different update without any error. Plugins
# whose optimizer steps whole tensors say so (``steps_whole_tensors``);
# the others refuse such an optimizer at boost.


def _refuse_whole_tensor_optimizer(plugin: Plugin, optimizer: Optimizer) -> None:
    if getattr(type(optimizer), "needs_whole_tensors", False) is not True:
        return
    if plugin.steps_whole_tensors:
        return
    raise ValueError(
        f"{type(optimizer).__name__} computes a norm of each whole parameter (its per-tensor "
        f"trust ratio), but {type(plugin).__name__} as configured steps shards of the "
        "parameters (ZeRO, Gemini, FSDP or tensor parallelism), where that norm would be a "
        "shard's and the update silently different. Fix: train it with TorchDDPPlugin, "
        "DDPPlugin or HybridParallelPlugin(tp_size=1, zero_stage=0) (pipelines and sequence "
        "parallelism keep whole tensors), or use an element-wise optimizer (AdamW, SGD) here."
    )


def _refuse_meta(model: nn.Module, plugin: str) -> None:
    """A model on the meta device holds no values to train from."""
    from pc_chunk import is_lazy

    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = next((n for n, t in tensors if t.is_meta and not is_lazy(t)), None)
    if meta is not None:
        raise ValueError(
            f"{plugin}: {meta} is on the meta device, which holds no values to train from. "
            "Build the model under pc_chunk.LazyInitContext instead (boost materialises each "
            "rank's share with the values eager construction gives), or load real weights "
            "into it before boost."
        )


def _model_facts(model: nn.Module) -> dict[str, int]:
    """Transformer blocks and attention heads, from a transformers config."""
    config = getattr(model, "config", None)
    facts = {}
    for key, names in (
        ("layers", ("num_hidden_layers", "n_layer")),
        ("heads", ("num_attention_heads", "n_head")),
    ):
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int):
                facts[key] = value
                break
    return facts


@runtime_checkable
class ScalesLoss(Protocol):
    """An optimizer that runs backward itself (the fp16 loss scale of the
    ZeRO and Gemini optimizers)."""

    def backward(self, loss: torch.Tensor) -> None: ...


# [Note: precision default]
# A plugin trains in the precision asked for (the plugin's ``precision=`` or
# the Booster's ``mixed_precision=``), else in the dtype the model was built
# in: a model built in fp32 trains in fp32, as it would without a plugin,
# and matches single-process training. (The compatibility edge's plugins
# keep their original's defaults: docs/migrate-colossalai.md.)


class Plugin(ABC):
    """Base of every plugin: built over its frozen options, which own its
    rules [Note: one place for every rule]. Subclasses implement
    :meth:`configure` and the four canonical state conversions."""

    options: PluginConfig
    #: the options dataclass whose fields are the constructor's settings
    #: [Note: options declared once]
    OPTIONS: ClassVar[type[PluginConfig]]
    #: the fields the constructor also takes by position, in order
    POSITIONAL: ClassVar[tuple[str, ...]] = ()
    # Whether the plugin takes ``precision=`` [Note: precision default].
    takes_precision: bool = False
    # Whether a model built on the meta device is materialised and
    # initialised by the plugin (FSDP2's own init pattern), not refused.
    initialises_meta: bool = False

    @property
    def steps_whole_tensors(self) -> bool:
        """Whether the optimizer steps each parameter whole (no ZeRO,
        Gemini, FSDP or tensor-parallel shard): what an optimizer with a
        per-tensor norm (LAMB's and LARS's trust ratio) needs
        [Note: whole-tensor optimizers]."""
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A plugin naming its ``OPTIONS`` registers itself as what they
        build, and its constructor's signature is made from their fields."""
        super().__init_subclass__(**kwargs)
        config = cls.__dict__.get("OPTIONS")
        if config is None:
            return
        register_plugin(config, cls)
        init = cls.__dict__.get("__init__")
        if init is not None:
            init.__signature__ = options_signature(init, config, cls.POSITIONAL)

    @classmethod
    def options_of(cls, args: tuple[Any, ...], given: dict[str, Any]) -> Any:
        """The constructor's options from its call: the options object, or
        the ``POSITIONAL`` fields' values, and the fields as keywords."""
        return options_from_arguments(cls.__name__, cls.OPTIONS, cls.POSITIONAL, args, given)

    def __init__(self, options: PluginConfig) -> None:
        # The plugin's settings; every rule is theirs.
        self.options = options
        # What is known of the run so far, checked against the rules each
        # time more is known (construction, Booster, boost, no_sync).
        self.setting = RunSetting(world=dist.get_world_size() if dist.is_initialized() else None)
        options.validate(self.setting)
        if isinstance(options, LossScaleOptions):
            options.loss_scale()  # a bad loss scale is refused here, not at boost
        # The models and optimizers this plugin boosted, by the objects
        # themselves (held by their record, so never reused as keys).
        self._boosted: dict[object, Boosted] = {}
        # The precision given to the plugin (``precision=``),
        # or None: then the Booster's, else the model's dtype.
        self.precision: TrainPrecision | None = None

    def set_precision(self, precision: str | None) -> None:
        """``precision=`` of the plugins that take it:
        'fp16', 'bf16' or 'fp32' (None: the Booster's ``mixed_precision``,
        else the dtype the model was built in) [Note: precision default]."""
        if precision is None:
            return
        self.precision = TrainPrecision.parse(precision, f"{type(self).__name__}: precision")
        self.validate_later(precision=self.precision)

    def validate_later(self, **known: Any) -> None:
        """Check the rules again now that ``known`` (fields of
        :class:`RunSetting`) is known; ValueError if one refuses."""
        self.setting = self.setting.with_(**known)
        self.options.validate(self.setting)

    # -- groups ----------------------------------------------------------------

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel ranks: the dataloader samples by rank in it."""
        group = dist.group.WORLD
        assert group is not None
        return group

    # The layout's sizes and groups, on every plugin: a script reads them
    # to count throughput (samples per step = batch x dp_size) or to pick
    # the rank that prints. Plugins without tensor or pipeline parallelism
    # have sizes 1 and no such groups.

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas (ranks in :attr:`dp_group`)."""
        return dist.get_world_size(self.dp_group)

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def pp_size(self) -> int:
        return 1

    @property
    def sp_size(self) -> int:
        return 1

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def stage_manager(self) -> Any:
        """The pipeline's :class:`~pc_booster.plugins.layout.PipelineStageManager`,
        or None without pipeline parallelism."""
        return None

    # -- boosting --------------------------------------------------------------

    @abstractmethod
    def configure(self, request: BoostRequest) -> Boosted: ...

    def boost(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: TrainPrecision | None,
    ) -> Boosted:
        """Check the rules against the model and precision, then wrap
        [Note: model dtype]: the run trains in ``precision`` (the Booster's
        ``mixed_precision``) or the plugin's ``precision=`` when given, else
        in the dtype the model was built in."""
        if not self.initialises_meta:
            _refuse_meta(model, type(self).__name__)
        dtype = _model_dtype(model)
        asked = precision
        if asked is not None and self.precision is not None and asked is not self.precision:
            raise ValueError(
                f"Booster(mixed_precision={asked.value!r}) and {type(self).__name__}(precision="
                f"{self.precision.value!r}) disagree; give the precision once."
            )
        asked = asked or self.precision
        effective = (
            asked if asked is not None else TrainPrecision.of_model(dtype) or TrainPrecision.FP32
        )
        self.validate_later(
            world=dist.get_world_size() if dist.is_initialized() else None,
            precision=effective,
            model_dtype=dtype,
            **_model_facts(model),
        )
        if optimizer is not None:
            _refuse_whole_tensor_optimizer(self, optimizer)
            own = {id(p) for p in model.parameters()}
            if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
                raise ValueError(
                    "the optimizer holds parameters that are not the model's: build it over "
                    "the model you pass to boost() (model.parameters(), or param groups of it)."
                )
        from pc_booster.plugins.optimizations import apply_block_options

        apply_block_options(model, self.options, torch_ddp=self.options.name == "torch-ddp")
        request = BoostRequest(model, optimizer, criterion, dataloader, lr_scheduler, effective)
        boosted = self.configure(request)
        self._boosted[boosted.model] = boosted
        if boosted.optimizer is not None:
            self._boosted[boosted.optimizer] = boosted
        return boosted

    def has_boosted(self, obj: Any) -> bool:
        """Whether ``obj`` is a model or optimizer this plugin boosted."""
        return inner_optimizer(obj) in self._boosted

    def boosted(self, obj: Any) -> Boosted:
        """The record of a model or optimizer this plugin boosted (the
        optimizer as ``boost`` returned it, or the one inside)."""
        found = self._boosted.get(inner_optimizer(obj))
        if found is None:
            raise ValueError(
                f"this {type(obj).__name__} was not boosted by this plugin; pass the objects "
                "booster.boost returned."
            )
        return found

    def backward(self, loss: torch.Tensor, optimizer: Optimizer) -> None:
        """``loss.backward()``, through the plugin's optimizer when it
        scales losses itself (pc-zero's); ``optimizer`` is the one inside
        the :class:`~pc_booster.wrappers.BoostedOptimizer`."""
        optimizer = inner_optimizer(optimizer)
        if isinstance(optimizer, ScalesLoss):
            optimizer.backward(loss)
        else:
            loss.backward()  # type: ignore[no-untyped-call, unused-ignore]

    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type[DistributedSampler[Any]] | None = None,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's share of ``dataset``: a
        DistributedSampler by data-parallel rank (tensor- and pipeline-
        parallel ranks of one replica read the same samples); ``pin_memory``,
        ``num_workers`` and ``kwargs`` are the DataLoader's;
        ``distributed_sampler_cls``: another sampler class, built with the
        same arguments."""
        group = self.dp_group
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler: DistributedSampler[Any] = sampler_cls(
            dataset,
            num_replicas=dist.get_world_size(group),
            rank=dist.get_rank(group),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )

    # -- canonical state -------------------------------------------------------

    @abstractmethod
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full tensors under the unwrapped model's keys, on every rank."""

    @abstractmethod
    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState: ...

    @abstractmethod
    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None: ...

    # -- sharded checkpoints [Note: sharded canonical state] ------------------------

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        """This rank's share of the model's canonical state, by DCP key; the
        tensors are the plugin's own (a load writes into them). ``loading``:
        also the copies this rank holds and another writes (a weight tied
        across pipeline stages)."""
        raise ValueError(
            f"{type(self).__name__} does not save sharded checkpoints yet; use shard=False."
        )

    def after_sharded_model_load(self, model: nn.Module) -> None:
        """Make the model use what a sharded load wrote (collective); by
        default the load wrote the model's own tensors, so nothing is left."""
        return

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        """This rank's share of the optimizer's canonical state, by DCP key.
        ``saved`` (loading): per parameter, the state keys the checkpoint
        holds and whether each is element-wise; missing state is created."""
        raise ValueError(
            f"{type(self).__name__} does not save sharded checkpoints yet; use shard=False."
        )

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Install what a sharded load read that is not written in place
        (hyperparameters, scalars, the loss scale); by default nothing."""
        return


class SupportsNoSync(ABC):
    """Gradient accumulation without communication."""

    @abstractmethod
    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]: ...


class SupportsPipeline(ABC):
    """Pipeline parallelism: the step runs through ``execute_pipeline``."""

    @abstractmethod
    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Optimizer,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]: ...
