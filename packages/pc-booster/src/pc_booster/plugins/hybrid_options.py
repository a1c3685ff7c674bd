"""The options of :class:`~pc_booster.plugins.hybrid.HybridParallelPlugin`
(:class:`HybridParallelOptions`) and the rules that accept or refuse a run
under them [Note: one place for every rule]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pc_booster.plugins.low_level_zero import zero_states
from pc_booster.rules import (
    LossScaleOptions,
    PluginConfig,
    Rule,
    RunSetting,
    StateBytes,
    TrainPrecision,
)

__all__ = ["OWN_SP_MODES", "PP_STYLES", "HybridParallelOptions"]


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
    if o.zero_stage == 3:
        return (
            "zero_stage=3: ZeRO-3 over tensor parallelism is TorchFSDPPlugin(tp_size=...) "
            "(FSDP2 over torch's tensor-parallel DTensors) or GeminiPlugin(tp_size=...); with "
            "pipelines it is not offered: each stage would gather its parameters again for "
            "every micro-batch, the traffic ZeRO-3 saves memory with, once per micro-batch. "
            "Use zero_stage=1 with pp_size."
        )
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


def _expert_parallel(o: HybridParallelOptions, setting: RunSetting) -> str | None:
    if o.ep_size < 1:
        return f"ep_size must be at least 1, got {o.ep_size}."
    if o.ep_size == 1:
        return None
    if setting.world is not None and (setting.world // max(o.model_parallel(), 1)) % o.ep_size:
        dp = setting.world // max(o.model_parallel(), 1)
        return (
            f"ep_size={o.ep_size} must divide the {dp} data-parallel ranks (world "
            f"{setting.world} / tp {o.tp_size} / pp {o.pp_size}); choose an ep_size that does."
        )
    # Combinations whose expert parallelism pc does not have yet.
    later = [
        ("Megatron's sequence parallelism (inside tp)", o.megatron_sp()),
    ]
    named = [name for name, given in later if given]
    if named:
        return (
            f"ep_size={o.ep_size} with {' and '.join(named)}: pc's expert parallelism does not "
            "combine with it yet. Use ep_size with tensor parallelism without "
            "enable_sequence_parallelism (or with Ulysses / ring sequence parallelism, "
            "sp_size), with pipelines, ZeRO, any precision and clipping; or ep_size=1 "
            "(experts replicated) for this layout."
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
        Rule(
            "zero_stage other than 0, 1, 2 (ZeRO-3 is TorchFSDPPlugin or GeminiPlugin)",
            _zero_stage,
            ({"zero_stage": 3}, RunSetting()),
        ),
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
            "ep_size not dividing the data-parallel ranks, or with Megatron's sequence "
            "parallelism (not yet)",
            _expert_parallel,
            ({"ep_size": 2, "tp_size": 2, "enable_sequence_parallelism": True}, RunSetting()),
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
    # Experts of each MoE block split over ep_size data-parallel ranks
    # (pc_tensor.shard_experts); 1: every rank holds every expert.
    ep_size: int = 1
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
        ep = f" ep{self.ep_size}" if self.ep_size > 1 else ""
        return f"hybrid tp{self.tp_size} pp{self.pp_size} zero{self.zero_stage}{sp}{ep}"

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        return zero_states(
            psi, dp, precision, self.zero_stage, offload=False, pipeline=self.pp_size > 1
        )
