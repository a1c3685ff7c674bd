"""Tensor x pipeline x data parallelism (:class:`HybridParallelPlugin`):
pc-tensor's ``shard_model`` over the tensor-parallel ranks, pc-pipeline's
stages over the pipeline ranks (:mod:`.hybrid_pipeline`), and pc-comm's DDP
or ZeRO-1/2 over the data-parallel ranks; its state conversions are in
:mod:`.hybrid_state`. Ranks are laid out tp innermost
(``pc_comm.make_subgroups``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState, names_by_id, rebuild_optimizer
from pc_booster.clipping import clip_at_next_step, clip_hook, refuse_error_if_nonfinite
from pc_booster.plugin import Boosted, Plugin, SupportsNoSync, SupportsPipeline
from pc_booster.plugins import hybrid_pipeline, hybrid_state
from pc_booster.plugins.common import (
    autocast_forward,
    broadcast_module,
    cast_floating,
    cast_floating_inputs,
    device,
    has_lazy,
    materialize_lazy,
    materializer,
    require_initialized,
    values_a_cast_rounds,
)
from pc_booster.plugins.layout import ParallelLayout, PipelineStageManager
from pc_booster.plugins.low_level_zero import (
    masters_from_built,
    zero_after_sharded_optimizer_load,
    zero_sharded_model_state,
    zero_sharded_optimizer_state,
    zero_states,
)
from pc_booster.plugins.optimizations import apply_optimizations
from pc_booster.plugins.sharded import (
    GROUPS,
    Share,
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
from pc_booster.step_policies import AmpStep
from pc_chunk import is_lazy

__all__ = ["HybridParallelOptions", "HybridParallelPlugin"]

PP_STYLES = ("1f1b", "interleaved", "zbv")


def _sizes(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    for name in ("tp_size", "pp_size"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be an int >= 1, got {value!r}."
    if o.num_microbatches is not None and (
        isinstance(o.num_microbatches, bool)
        or not isinstance(o.num_microbatches, int)
        or o.num_microbatches < 1
    ):
        return f"num_microbatches must be an int >= 1, got {o.num_microbatches!r}."
    if not o.pp_timeout > 0:
        return f"pp_timeout must be positive seconds, got {o.pp_timeout!r}."
    return None


def _zero_stage(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.zero_stage not in (0, 1, 2):
        return f"zero_stage must be 0, 1 or 2, got {o.zero_stage!r}."
    return None


def _pp_style(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.pp_style not in PP_STYLES:
        return f"pp_style must be one of {', '.join(map(repr, PP_STYLES))}, got {o.pp_style!r}."
    return None


def _world(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    mp = o.tp_size * o.pp_size
    if setting.world is not None and setting.world % mp:
        return (
            f"tp_size ({o.tp_size}) x pp_size ({o.pp_size}) = {mp} does not divide the world "
            f"size ({setting.world}); the data-parallel size would be {setting.world / mp:.3g}. "
            "Choose sizes whose product divides the number of processes."
        )
    return None


def _zero2_pipeline(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.zero_stage == 2 and o.pp_size > 1:
        return (
            "ZeRO-2 shards gradients, which every micro-batch's backward of a pipeline would "
            f"have to reduce; use zero_stage=1 with pp_size={o.pp_size}."
        )
    return None


def _sp_needs_tp(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.megatron_sp() and o.tp_size == 1:
        return (
            "sequence parallelism ('split_gather') splits the sequence over the tensor-"
            "parallel ranks; set tp_size > 1, or sequence_parallelism_mode='all_to_all' with "
            "an sp_size (Ulysses), or enable_sequence_parallelism=False."
        )
    return None


def _sp_pipeline(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.megatron_sp() and o.pp_size > 1:
        return (
            "sequence parallelism ('split_gather', inside tensor parallelism) with pipelines "
            "is not supported yet; use sequence_parallelism_mode='all_to_all' or 'ring_attn' "
            "with an sp_size, or set one of them off."
        )
    if o.enable_sequence_parallelism and o.pp_size > 1 and o.tp_size > 1:
        return (
            f"sequence_parallelism_mode={o.sequence_parallelism_mode!r} inside pipeline stages "
            "with tensor parallelism too (tp_size > 1) is not in pc yet; use two of the three."
        )
    return None


# [Note: mixed precision without ZeRO]
# With zero_stage=0 the parameters themselves stay fp32 (they are the
# masters), the forward (of each pipeline stage) runs under torch.autocast in
# the run's precision, so the activations between stages keep the residual
# stream's fp32, and for fp16 the
# returned optimizer's step policy (AmpStep) scales the loss, unscales the
# gradients after the data-parallel all-reduce and skips a step that
# overflowed on any tensor- or pipeline-parallel rank; clipping (a step
# pre-hook of the optimizer) sees unscaled gradients. A model built in bf16
# or fp16 is cast up: its fp32 parameters hold the half values exactly, as
# the fp32 masters an AMP optimizer would make of them. With zero_stage >= 1
# the ZeRO optimizer keeps fp32 masters of a half model instead.


def _layers_split(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    stages = o.pp_size * o.chunks_per_rank()
    counts = o.num_layers_per_stage
    if counts is not None:
        if o.pp_size == 1:
            return f"num_layers_per_stage={list(counts)} without pipeline stages; pass pp_size > 1."
        if len(counts) != stages or min(counts) < 1:
            return (
                f"num_layers_per_stage={list(counts)} must give {stages} positive stage sizes "
                f"(pp_size={o.pp_size} x {o.chunks_per_rank()} chunks per rank)."
            )
        if setting.layers is not None and sum(counts) != setting.layers:
            return (
                f"num_layers_per_stage={list(counts)} sums to {sum(counts)}, but the model has "
                f"{setting.layers} transformer blocks; give sizes that add up to it."
            )
        return None
    if o.pp_size > 1 and setting.layers is not None and setting.layers % stages:
        return (
            f"the model's {setting.layers} transformer blocks do not split evenly into "
            f"{stages} pipeline stages (pp_size={o.pp_size}"
            f"{f', {o.chunks_per_rank()} chunks per rank' if o.chunks_per_rank() > 1 else ''}); "
            "choose a pp_size that divides the number of layers, or give each stage's count "
            "with num_layers_per_stage."
        )
    return None


def _heads_split(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.tp_size > 1 and setting.heads is not None and setting.heads % o.tp_size:
        return (
            f"the model's {setting.heads} attention heads do not split over tp_size="
            f"{o.tp_size}; choose a tp_size that divides the number of heads."
        )
    return None


def _pipeline_accumulation(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.pp_size > 1 and (setting.accumulation or 1) > 1:
        return (
            "a pipeline step already accumulates its micro-batches: raise num_microbatches "
            f"instead of accumulating {setting.accumulation} steps (no_sync) with pp_size > 1."
        )
    return None


SP_MODES = ("split_gather", "all_to_all", "ring_attn")
# Sequence parallelism over sp_size ranks of its own (not inside tp).
OWN_SP_MODES = ("all_to_all", "ring_attn")


def _microbatch_size(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.microbatch_size is None:
        return None
    if isinstance(o.microbatch_size, bool) or not isinstance(o.microbatch_size, int):
        return f"microbatch_size must be an int >= 1, got {o.microbatch_size!r}."
    if o.microbatch_size < 1:
        return f"microbatch_size must be an int >= 1, got {o.microbatch_size!r}."
    if o.num_microbatches is not None:
        return (
            f"num_microbatches ({o.num_microbatches}) and microbatch_size ({o.microbatch_size}) "
            "both say how a batch splits; give one of them."
        )
    return None


def _model_chunks(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.num_model_chunks is None or o.num_model_chunks == o.chunks_per_rank():
        return None
    return (
        f"num_model_chunks={o.num_model_chunks} with pp_style={o.pp_style!r}, which holds "
        f"{o.chunks_per_rank()} model chunk(s) per rank; pc's interleaved schedule holds 2: "
        "pass pp_style='interleaved' with num_model_chunks=2 (or leave num_model_chunks out)."
    )


def _sp_mode(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    mode = o.sequence_parallelism_mode
    if mode is not None and mode not in SP_MODES:
        return (
            f"sequence_parallelism_mode={mode!r}: pc has 'split_gather' (Megatron's sequence "
            "parallelism over the tensor-parallel ranks), 'all_to_all' (Ulysses) and "
            "'ring_attn' (ring attention), the last two over sp_size ranks of their own."
        )
    if mode is not None and not o.enable_sequence_parallelism:
        return (
            f"sequence_parallelism_mode={mode!r} without enable_sequence_parallelism=True; "
            "turn sequence parallelism on, or drop the mode."
        )
    if mode in OWN_SP_MODES:
        if isinstance(o.sp_size, bool) or not isinstance(o.sp_size, int) or o.sp_size < 2:
            return (
                f"sequence_parallelism_mode={mode!r} with sp_size={o.sp_size!r}: it splits "
                "the sequence over sp_size ranks of its own; pass sp_size >= 2."
            )
        if setting.world is not None and setting.world % (o.sp_size * o.tp_size * o.pp_size):
            return (
                f"sp_size={o.sp_size} x tp_size={o.tp_size} x pp_size={o.pp_size} must divide "
                f"the world ({setting.world})."
            )
        return None
    if o.sp_size not in (None, 1):
        return (
            f"sp_size={o.sp_size}: 'split_gather' sequence parallelism runs over the "
            "tensor-parallel ranks, so it has no size of its own; leave sp_size out, or pass "
            "sequence_parallelism_mode='all_to_all' (Ulysses) for sequence parallelism of "
            "its own size."
        )
    return None


def _refused_extras(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.cpu_offload and o.zero_stage == 0:
        return "cpu_offload offloads ZeRO's masters and moments: set zero_stage=1 or 2."
    ddp_options = (o.ddp_bucket_cap_mb, o.find_unused_parameters, o.gradient_as_bucket_view)
    if o.zero_stage and ddp_options != (25.0, False, False):
        return (
            "ddp_bucket_cap_mb / find_unused_parameters / gradient_as_bucket_view are pc-comm "
            f"DDP's, used with zero_stage=0; zero_stage={o.zero_stage} reduces through ZeRO's "
            "own buckets (zero_bucket_size_in_m). Drop them or set zero_stage=0."
        )
    if not o.zero_stage and (o.zero_bucket_size_in_m != 12.0 or not o.overlap_communication):
        return (
            "zero_bucket_size_in_m / overlap_communication are ZeRO's, used with zero_stage 1 "
            "or 2; zero_stage=0 reduces through pc-comm DDP (ddp_bucket_cap_mb). Drop them or "
            "set a zero_stage."
        )
    if not o.parallel_output and o.pp_size > 1:
        return (
            "parallel_output=False with pp_size > 1: the last stage's criterion gets the "
            "vocabulary-parallel logits (outputs.logits); gather them there with "
            "pc_tensor.gather_logits, or use pp_size=1."
        )
    return None


@dataclass(frozen=True)
class HybridParallelOptions(PluginConfig, LossScaleOptions):
    """``tp_size`` x ``pp_size`` ranks per model replica, the rest data
    parallel; ``zero_stage`` 0 (pc-comm DDP), 1 or 2 (ZeRO over the
    data-parallel ranks); ``num_microbatches`` per pipeline step (default
    ``pp_size``); ``pp_style`` ``"1f1b"``, ``"interleaved"`` (two model
    chunks per rank) or ``"zbv"`` (zero-bubble, split backward);
    ``max_norm``: clipping by the norm over every rank's gradients."""

    name: ClassVar[str] = "hybrid"
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "tp_size, pp_size, num_microbatches or pp_timeout out of range",
            _sizes,
            ({"tp_size": 0}, RunSetting()),
        ),
        Rule("zero_stage other than 0, 1, 2", _zero_stage, ({"zero_stage": 3}, RunSetting())),
        Rule("unknown pp_style", _pp_style, ({"pp_style": "gpipe"}, RunSetting())),
        Rule(
            "tp_size x pp_size not dividing the world size",
            _world,
            ({"tp_size": 3}, RunSetting(world=4)),
        ),
        Rule(
            "zero_stage=2 with pipelines",
            _zero2_pipeline,
            ({"zero_stage": 2, "pp_size": 2}, RunSetting()),
        ),
        Rule(
            "sequence parallelism without tensor parallelism",
            _sp_needs_tp,
            ({"enable_sequence_parallelism": True}, RunSetting()),
        ),
        Rule(
            "sequence parallelism with pipelines",
            _sp_pipeline,
            ({"enable_sequence_parallelism": True, "tp_size": 2, "pp_size": 2}, RunSetting()),
        ),
        Rule(
            "pipeline stages not dividing the transformer blocks",
            _layers_split,
            ({"pp_size": 2, "pp_style": "interleaved"}, RunSetting(layers=6)),
        ),
        Rule(
            "tp_size not dividing the attention heads",
            _heads_split,
            ({"tp_size": 4}, RunSetting(heads=6)),
        ),
        Rule(
            "gradient accumulation (no_sync) with pipelines",
            _pipeline_accumulation,
            ({"pp_size": 2}, RunSetting(accumulation=4)),
        ),
        Rule(
            "microbatch_size out of range, or with num_microbatches",
            _microbatch_size,
            ({"microbatch_size": 2, "num_microbatches": 2}, RunSetting()),
        ),
        Rule(
            "num_model_chunks other than the schedule's",
            _model_chunks,
            ({"num_model_chunks": 2}, RunSetting()),
        ),
        Rule(
            "ring attention, or an sp_size without all_to_all",
            _sp_mode,
            (
                {"sequence_parallelism_mode": "ring", "enable_sequence_parallelism": True},
                RunSetting(),
            ),
        ),
        Rule(
            "ZeRO's options without ZeRO, DDP's with it, or parallel_output=False with pipelines",
            _refused_extras,
            ({"cpu_offload": True, "zero_stage": 0}, RunSetting()),
        ),
    )

    tp_size: int = 1
    pp_size: int = 1
    zero_stage: int = 0
    num_microbatches: int | None = None
    pp_style: str = "1f1b"
    enable_sequence_parallelism: bool = False
    max_norm: float = 0.0
    pp_timeout: float = 300.0
    # Transformer blocks per pipeline stage (None: an even split); the first
    # stage also holds the embedding, the last the head.
    num_layers_per_stage: tuple[int, ...] | None = None
    # Buffers re-broadcast from the first data-parallel rank before each
    # forward (torch DDP's), without pipelines and ZeRO.
    broadcast_buffers: bool = True
    # Micro-batches, model chunks and sequence parallelism.
    microbatch_size: int | None = None
    num_model_chunks: int | None = None
    sequence_parallelism_mode: str | None = None
    sp_size: int | None = None
    enable_flash_attention: bool = False
    enable_fused_normalization: bool = False
    overlap_communication: bool = True
    parallel_output: bool = True
    zero_bucket_size_in_m: float = 12.0
    cpu_offload: bool = False
    ddp_bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False

    def flash_attention(self) -> bool:
        return self.enable_flash_attention

    def fused_normalization(self) -> bool:
        return self.enable_fused_normalization

    def chunks_per_rank(self) -> int:
        return 2 if self.pp_style == "interleaved" else 1

    def megatron_sp(self) -> bool:
        """Megatron's sequence parallelism inside tensor parallelism (the
        default mode), not Ulysses'."""
        return (
            self.enable_sequence_parallelism and self.sequence_parallelism_mode not in OWN_SP_MODES
        )

    def model_parallel(self) -> int:
        return self.tp_size * self.pp_size

    def microbatches(self) -> int:
        return self.num_microbatches or self.pp_size

    def describe(self) -> str:
        sp = " sp" if self.enable_sequence_parallelism else ""
        return f"hybrid tp{self.tp_size} pp{self.pp_size} zero{self.zero_stage}{sp}"

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        return zero_states(
            psi, dp, precision, self.zero_stage, offload=False, pipeline=self.pp_size > 1
        )


class HybridParallelPlugin(Plugin, SupportsNoSync, SupportsPipeline):
    """Tensor parallelism (pc-tensor's ``shard_model``, optionally with
    sequence parallelism) x pipeline parallelism x data parallelism
    (:class:`HybridParallelOptions`). ``layout``: the process groups, built
    once per job and shared by plugins of the same sizes (default: built on
    first use)."""

    options: HybridParallelOptions

    takes_precision = True

    OPTIONS = HybridParallelOptions
    POSITIONAL = ("tp_size", "pp_size")

    def __init__(
        self,
        *args: Any,
        precision: str | None = None,
        layout: ParallelLayout | None = None,
        **fields: Any,
    ) -> None:
        """``HybridParallelPlugin(tp_size=2, pp_size=2, ...)``: the fields of
        :class:`HybridParallelOptions` (or the options object), ``precision=``
        and ``layout=``, process groups already made for these sizes
        [Note: options declared once]."""
        if fields.get("num_layers_per_stage") is not None:
            fields["num_layers_per_stage"] = tuple(fields["num_layers_per_stage"])
        super().__init__(self.options_of(args, fields))
        self.set_precision(precision)
        o = self.options
        if layout is not None and (layout.tp_size, layout.pp_size) != (o.tp_size, o.pp_size):
            raise ValueError(
                f"HybridParallelPlugin: layout has tp {layout.tp_size} x pp {layout.pp_size}, the "
                f"plugin tp_size {o.tp_size} x pp_size {o.pp_size}; pass a layout of the same "
                "sizes."
            )
        # The process groups: built once, on first use (every rank then).
        self._layout = layout
        # Set by configure: this rank's pipeline stage.
        self.stage = hybrid_pipeline.PipelineStage()
        # zero_stage=0: each boosted optimizer's clipping across the tp and
        # pp groups (clip_grad_by_norm calls it).
        self.clippers: dict[Optimizer, Callable[[Sequence[torch.Tensor], float], float]] = {}

    # The layout's sizes and groups, by the names training scripts read.
    @property
    def tp_size(self) -> int:
        return self.options.tp_size

    @property
    def pp_size(self) -> int:
        return self.options.pp_size

    @property
    def zero_stage(self) -> int:
        return self.options.zero_stage

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            require_initialized("HybridParallelPlugin")
            self._layout = ParallelLayout.build(tp=self.tp_size, pp=self.pp_size, sp=self.sp_size)
        return self._layout

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that read different batches (Ulysses' sequence-parallel
        ranks share one); gradients are averaged over ``layout.dp_group``."""
        return self.layout.batch_group

    @property
    def sp_size(self) -> int:
        """Ulysses' sequence-parallel ranks (1 unless all_to_all)."""
        o = self.options
        return o.sp_size if o.sequence_parallelism_mode in OWN_SP_MODES and o.sp_size else 1

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.layout.sp_group

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.layout.tp_group

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.layout.pp_group

    @property
    def stage_manager(self) -> PipelineStageManager | None:
        if self.pp_size == 1:
            return None
        chunks = 2 if self.options.pp_style in ("interleaved", "zbv") else 1
        return PipelineStageManager(self.layout.pp_group, num_model_chunks=chunks)

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Any,
        dataloader: Any,
        lr_scheduler: Any,
        precision: TrainPrecision,
    ) -> Boosted:
        from pc_comm import DistributedDataParallel
        from pc_tensor import shard_model

        layout = self.layout
        names = names_by_id(model)
        apply_optimizations(model, self.options)
        if self.pp_size > 1:
            return hybrid_pipeline.configure_pipeline(
                self, model, names, optimizer, criterion, dataloader, lr_scheduler, precision
            )
        if self.tp_size > 1 and has_lazy(model):
            # Each layer materialised as it is split: the whole model never
            # exists here. Every rank replays the same values (no broadcast).
            shard_model(
                model,
                layout.tp_group,
                sequence_parallel=self.options.megatron_sp(),
                materialize=materializer(device()),
            )
            model = model.to(device())
        else:
            materialize_lazy([model], device())
            model = model.to(device())
            broadcast_module(model)
            if self.tp_size > 1:
                shard_model(
                    model,
                    layout.tp_group,
                    sequence_parallel=self.options.megatron_sp(),
                )
        if self.sp_size > 1:  # gradients averaged over dp x sp, so scaled by sp
            from pc_tensor import ring_model, ulysses_model

            assert layout.sp_group is not None
            wrap = (
                ulysses_model
                if self.options.sequence_parallelism_mode == "all_to_all"
                else ring_model
            )
            wrap(model, layout.sp_group, grad_scale=float(self.sp_size))
        built = values_a_cast_rounds([model], precision.dtype) if self.zero_stage else {}
        amp = not self.zero_stage and precision is not TrainPrecision.FP32
        if amp:  # [Note: mixed precision without ZeRO]
            cast_floating(model, torch.float32)
            autocast_forward(model, precision.dtype)
        else:
            cast_floating(model, precision.dtype)
            if precision is not TrainPrecision.FP32:  # an fp32 batch into a half model
                cast_floating_inputs(model, precision.dtype)
        step_policy = None
        wrapped: nn.Module = model
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
        if self.zero_stage:
            if optimizer is None:
                raise ValueError("zero_stage > 0 shards an optimizer: pass one to boost().")
            zero = self.zero_optimizer(optimizer)
            masters_from_built(model, zero, built)
            optimizer = zero
        else:
            if dist.get_world_size(layout.dp_group) > 1:
                wrapped = DistributedDataParallel(
                    model,
                    process_group=layout.dp_group,
                    bucket_cap_mb=self.options.ddp_bucket_cap_mb,
                    find_unused_parameters=self.options.find_unused_parameters,
                    gradient_as_bucket_view=self.options.gradient_as_bucket_view,
                    broadcast_buffers=self.options.broadcast_buffers,
                )
            if optimizer is not None:
                self.clip_own_optimizer(optimizer)
                if precision is TrainPrecision.FP16:
                    # The overflow check spans the model-parallel ranks,
                    # which hold different pieces of the gradients.
                    step_policy = AmpStep(
                        self.options.loss_scale(), device(), groups=self.norm_groups()
                    )
        if self.tp_size > 1 and not self.options.parallel_output:
            model.register_forward_hook(_full_logits)
        return Boosted(
            wrapped, optimizer, criterion, dataloader, lr_scheduler, module=model,
            step_policy=step_policy,
        )  # fmt: skip

    # -- clipping and loss scaling across every group holding gradients ---------------

    def counts_toward_norm(self, param: torch.Tensor, name: str | None = None) -> bool:
        """Whether this rank counts ``param`` in the global gradient norm:
        each weight once across the model-parallel ranks (a tensor-parallel
        shard on every tp rank, a replicated weight on tp rank 0; a weight
        tied across stages on the stage that trains it)."""
        layout = self.layout
        if self.tp_size > 1 and not self._tp_counts(param):
            return False
        if self.pp_size > 1 and name is not None:
            return self.stage.stage_of.get(name, layout.coord.pp) == layout.coord.pp
        return True

    @cached_property
    def _tp_counts(self) -> Callable[[torch.Tensor], bool]:
        """pc-zero's tensor-parallel rule: sharded weights on every tp rank,
        replicated ones on tp rank 0."""
        from pc_zero import counts_under_tensor_parallel

        return counts_under_tensor_parallel(self.layout.tp_group)

    def norm_groups(self) -> list[dist.ProcessGroup]:
        groups = []
        if self.tp_size > 1:
            groups.append(self.layout.tp_group)
        if self.pp_size > 1:
            groups.append(self.layout.pp_group)
        return groups

    def zero_optimizer(self, optimizer: Optimizer, names: dict[int, str] | None = None) -> Any:
        """ZeRO over the data-parallel ranks, clipping by (and deciding fp16
        overflow on) the norm over the tensor and pipeline ranks too."""
        from pc_zero import LowLevelZeroOptimizer

        o = self.options
        by_id = names or {}
        return LowLevelZeroOptimizer(
            optimizer,
            stage=o.zero_stage,
            dp_process_group=self.layout.dp_group,
            model_parallel_groups=self.norm_groups(),
            counts_toward_norm=lambda p: self.counts_toward_norm(p, by_id.get(id(p))),
            clip_grad_norm=o.max_norm,
            loss_scale=o.loss_scale(),
            overlap_communication=o.overlap_communication,
            cpu_offload=o.cpu_offload,
            reduce_bucket_size=int(o.zero_bucket_size_in_m * 2**20),
        )

    def clip_own_optimizer(self, optimizer: Optimizer, names: dict[int, str] | None = None) -> None:
        """zero_stage=0: clip the user's optimizer's gradients (whole on
        each data-parallel rank after DDP) by the global norm before each
        step (with ``max_norm``; ``optimizer.clip_grad_by_norm`` uses the
        same clipping)."""
        from pc_zero import unscale_clip_and_check

        by_id = names or {}

        def clip(params: Sequence[torch.Tensor], max_norm: float) -> float:
            # The gradients themselves (scaled in place), not flattened copies.
            grads = [p.grad for p in params if p.grad is not None]
            counted = [
                [(0, g.numel())] if self.counts_toward_norm(p, by_id.get(id(p))) else []
                for p, g in zip(params, grads, strict=True)
            ]
            _, norm = unscale_clip_and_check(
                grads,
                None,
                None,
                max_norm,
                device(),
                count_ranges=counted,
                model_parallel_groups=self.norm_groups(),
            )
            return norm

        self.clippers[optimizer] = clip
        if self.options.max_norm > 0:
            optimizer.register_step_pre_hook(clip_hook(self.options.max_norm, clip))

    def clip_grad_by_norm(
        self, optimizer: Any, max_norm: float, error_if_nonfinite: bool = False
    ) -> None:
        refuse_error_if_nonfinite(self, error_if_nonfinite)
        if self.zero_stage:
            clip_at_next_step(optimizer, "clip_grad_norm", max_norm)
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.clippers[optimizer](params, max_norm)

    # -- steps -------------------------------------------------------------------------

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
        batch of ``data_iter`` [see :func:`.hybrid_pipeline.execute_pipeline`].
        Then call ``optimizer.step()``."""
        return hybrid_pipeline.execute_pipeline(
            self, data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    def no_sync(self, model: nn.Module, optimizer: Any) -> AbstractContextManager[None]:
        self.validate_later(accumulation=2)  # refused with pipelines
        if self.zero_stage == 1:
            if optimizer is None:
                raise ValueError(
                    "with zero_stage=1 gradients accumulate in the optimizer: pass it, "
                    "booster.no_sync(model, optimizer)."
                )
            context: AbstractContextManager[None] = optimizer.no_sync()
            return context
        from pc_comm import DistributedDataParallel

        if self.zero_stage == 2 or not isinstance(model, DistributedDataParallel):
            return nullcontext()  # ZeRO-2 accumulates in its shard; dp 1 has nothing to sync
        context = model.no_sync()
        return context

    # -- sharded checkpoints [Note: sharded canonical state] -----------------------------

    def _share(self, module: nn.Module, loading: bool) -> Share:
        """What this rank writes: its stage's tensors (a weight tied across
        stages from the stage that trains it; every holder reads it back),
        its tensor-parallel shards placed in the full tensors."""
        names = None
        if self.pp_size > 1:
            assert self.stage.stage_params is not None, (
                "configure sets stage_params under pipelines"
            )
            me = self.layout.coord.pp
            params = {
                n for n in self.stage.stage_params if loading or self.stage.stage_of.get(n) == me
            }
            buffers = {n for n, b in module.named_buffers() if not (b.is_meta or is_lazy(b))}
            names = frozenset(params | buffers)
        if self.tp_size == 1:
            return Share(names)
        from pc_tensor import shard_info

        info = shard_info(module)
        group = info.group
        return Share(names, info.specs, dist.get_rank(group), dist.get_world_size(group))

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        boosted = self.boosted(model)
        share = self._share(boosted.module, loading)
        if self.zero_stage:
            return zero_sharded_model_state(boosted.module, boosted.optimizer, share)
        return whole_state(boosted.module, share)

    def after_sharded_model_load(self, model: nn.Module) -> None:
        if self.zero_stage:
            self.boosted(model).optimizer.sync_params()

    def sharded_optimizer_state(
        self, optimizer: Any, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        module = self.boosted(optimizer).module
        share = self._share(module, loading=saved is not None)
        if self.zero_stage:
            out = zero_sharded_optimizer_state(module, optimizer, saved, share)
        else:
            out = own_optimizer_state(module, optimizer, saved, share)
        if self.pp_size > 1 and saved is None:
            out[GROUPS] = self._every_stage_groups(out[GROUPS])
        return out

    def _every_stage_groups(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The groups with every stage's parameter names (collective over
        the pipeline ranks; names only, a few bytes per parameter)."""
        stages: list[Any] = [None] * self.pp_size
        dist.all_gather_object(stages, mine, group=self.layout.pp_group)
        merged = []
        for index, group in enumerate(mine):
            names = [n for stage in stages for n in stage[index]["params"]]
            merged.append({**group, "params": list(dict.fromkeys(names))})
        return merged

    def after_sharded_optimizer_load(self, optimizer: Any, state: dict[str, Any]) -> None:
        module = self.boosted(optimizer).module
        if self.zero_stage:
            zero_after_sharded_optimizer_load(module, optimizer, state)
        else:
            after_own_optimizer_load(module, optimizer, state)

    # -- canonical state ---------------------------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return hybrid_state.model_state_dict(self, model)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        hybrid_state.load_model_state_dict(self, model, state)

    def optimizer_state_dict(self, optimizer: Any) -> CanonicalOptimizerState:
        return hybrid_state.optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer: Any, state: CanonicalOptimizerState) -> None:
        hybrid_state.load_optimizer_state_dict(self, optimizer, state)


# [Note: kernels and outputs of the hybrid plugin]
# What each option asks, with what torch has:
# - enable_flash_attention: the model's attention through torch's
#   scaled_dot_product_attention (transformers' "sdpa"), whose CUDA kernels
#   are FlashAttention's;
# - enable_fused_normalization: RMS norms through torch's fused rms_norm
#   (LayerNorm is one fused kernel in torch already);
# - parallel_output=False: a tensor-parallel model's logits gathered to the
#   full vocabulary after the forward (True keeps each rank's slice, which
#   is what the loss uses);
# - zero_bucket_size_in_m, cpu_offload: the ZeRO optimizer's bucket size
#   and host offload; ddp_bucket_cap_mb, find_unused_parameters,
#   gradient_as_bucket_view: pc-comm DDP's (zero_stage=0).


def _full_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """parallel_output=False: the full vocabulary's logits."""
    from pc_tensor import gather_logits

    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        output.logits = gather_logits(logits, module)
    return output
