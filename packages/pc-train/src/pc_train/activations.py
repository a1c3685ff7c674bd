"""What pc-estimate counts of a step's activations: the blocks' kept
tensors (with recomputation, in-flight pipeline micro-batches, sequence
and expert parallelism) and ZeRO-2's gradient bucket in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pc_train.options import PluginKind, PluginOptions

if TYPE_CHECKING:
    from pc_train.shape import ModelShape

__all__ = [
    "BUBBLE_DIVISOR",
    "COMPILED_TIME",
    "RECOMPUTE_COST",
    "activation_bytes",
    "bucket_in_flight",
    "fsdp_gathered_bytes",
    "step_working_bytes",
]


def activation_bytes(
    shape: ModelShape,
    options: PluginOptions,
    micro_batch: int,
    seq: int,
    precision: str,
    fused_attention: bool = False,
) -> int:
    """Activations one rank keeps for backward. ``fused_attention``: the
    attention scores are never kept (a GPU's flash and memory-efficient
    kernels keep the softmax's log-sum-exp only); on a CPU, where the causal
    mask transformers passes sends SDPA to its plain path, they are (5 a s
    / h per token: Megatron's term, measured here)."""
    s, b, h, a, t = seq, micro_batch, shape.hidden, shape.heads, options.tp
    a = 0 if fused_attention else a
    transient = 0.0  # held while computed, not kept for backward
    # Half-width activations where the weights are: the hybrid plugin
    # without ZeRO keeps fp32 weights and autocasts the matrix multiplies,
    # so the residual stream, norms and softmax stay fp32 (measured: its
    # peak in bf16 is its peak in fp32).
    amp = options.kind is PluginKind.HYBRID and options.zero_stage == 0
    scale = 2.0 if precision == "fp32" or amp else 1.0
    if options.sequence_parallel:
        per_layer = s * b * h * (34 + 5 * a * s / h) / t
    elif options.sp > 1:
        # Ulysses and ring attention: 1/sp of the tokens everywhere. Ulysses'
        # attention is SDPA's fused kernel (no scores kept); ring
        # attention's scores exist for one pair of blocks of s / 2sp tokens
        # at a time, in one layer (on the CPU the pair runs the fused kernel
        # and they do not exist at all: this is the bound elsewhere).
        per_layer = s * b * h * (10 + 24 / t) / options.sp
        if options.sp_mode == "ring_attn":  # fp32 scores and probabilities, once
            block = s / (2 * options.sp)
            transient = 2 * 4 * a * b * block * block / t
    else:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    layers = max(options.rank_blocks(shape.layers))  # the busiest rank's
    in_flight = float(min(options.pp, options.microbatches or options.pp) if options.pp > 1 else 1)
    if options.model_chunks > 1:  # [Note: pipeline schedules in the estimate]
        in_flight += (options.pp - 1) / options.model_chunks
    elif options.pp_style == "zbv":
        in_flight += options.pp - 1
    # fp32 logits, softmax, gradient; split by vocabulary under pc-tensor's
    # tensor parallelism, whole under FSDP2's (its output layer is whole).
    vocab_split = 1 if options.kind is PluginKind.FSDP else t
    logits = 3 * b * s * shape.vocab * 4 / (vocab_split * options.sp)
    total = per_layer * layers
    if options.activation_checkpointing != "none":  # [Note: recomputation in the estimate]
        recomputed = layers * options.activation_checkpointing_fraction
        if options.activation_checkpointing == "full":
            block_input = 2 * s * b * h / (options.sp * (t if options.sequence_parallel else 1))
            total = per_layer * (layers - recomputed) + block_input * recomputed
            # One block's activations while it is recomputed: one micro-batch at a time.
            transient += (2.0 if precision == "fp32" or amp else 1.0) * per_layer
        else:
            total = per_layer * (layers - recomputed * (1 - _SELECTIVE_KEPT))
    if shape.moe_layers and options.ep > 1:  # [Note: activations of a mixture of experts]
        rows = s * b * shape.top_k / options.sp
        routed = rows * (h + 4 * shape.expert_ffn) * 2
        total += (_BUSIEST_RANK - 1) * routed * shape.moe_layers / options.pp
    return int(scale * total * in_flight + logits + transient)


# [Note: recomputation in the estimate]
# Full recomputation keeps each recomputed block's input (half-width: 2
# bytes per element before the fp32 scale) and, in backward, one block's
# whole activations at a time. Selective recomputation keeps the outputs of
# the matrix products and attention: in a Llama block with an MLP 2.7
# times as wide, q, k, v, o, gate, up and down's outputs are about 60 % of
# what the block keeps. Compute: a full recomputation repeats the block's
# forward (a third of its step's FLOPs), a selective one its pointwise
# operations (about 5 %); compiling each block is 16 % more tokens per
# second (torchtitan's measurement on 8 H100s; 19 % on this project's CPU,
# docs/benchmarks.md).
_SELECTIVE_KEPT = 0.6
RECOMPUTE_COST = {"none": 0.0, "full": 1 / 3, "selective": 0.05}
COMPILED_TIME = 1 / 1.16

# [Note: pipeline schedules in the estimate]
# With m micro-batches on pp stages, 1F1B idles (pp - 1) / m of a step (its
# bubble) and its first rank holds pp micro-batches' activations of its
# blocks. Interleaved 1F1B with v = 2 model chunks per rank (Narayanan et
# al., 2021) divides the bubble by v and holds (1 + (pp - 1) / (pp v))
# times 1F1B's activations on the first rank: pp + (pp - 1) / v micro-
# batches of its blocks. Zero bubble (pc's "zbv", one chunk per rank;
# Qi et al., 2023, ZB-H1) splits backward into the input and the weight
# gradients and fills the bubble with the latter: about a third of
# 1F1B's (forward, input and weight backward taking equal time). Its
# paper keeps 1F1B's memory; pc's schedule defers the weight gradients of
# up to pp - 1 micro-batches and holds their activations meanwhile:
# measured (tools/calibrate_estimate.py, llama-small, pp 2) 30.2 MiB at
# the peak against 1F1B's 22.3, about one micro-batch of the stage's
# activations more, so it counts pp + (pp - 1) in flight (measured at pp
# 2 only). The bubble's divisor per schedule:
BUBBLE_DIVISOR = {"1f1b": 1.0, "interleaved": 2.0, "zbv": 3.0}


# [Note: activations of a mixture of experts]
# A mixture-of-experts block keeps, for each (token, expert) row it
# routes, the row's input, the gate-and-up projection's output (two ffn
# wide), the activation and the gated product (ffn each). Without expert
# parallelism a rank computes its own tokens' rows, top_k per token, which
# the dense formula's MLP share covers at the sizes measured. Under expert
# parallelism it computes the rows routed to its experts: on average as
# many, but as many as the router sends. The busiest of 2 ranks on a
# freshly initialised Mixtral (mixtral-small, integration_tests/
# test_pc_estimate.py) holds about 1.3 times the average; the estimate
# allows for that much more on every rank.
_BUSIEST_RANK = 1.3


def bucket_in_flight(plugin: Any, psi: float, grad_bytes: int) -> int:
    """ZeRO-2 keeps only its shard of the gradients, but autograd makes
    each gradient whole first: a bucket's worth (``reduce_bucket_size_in_m``
    / ``zero_bucket_size_in_m`` million elements, or the whole model part
    when smaller) is alive until its reduce-scatter, beside the activations
    backward still holds."""
    stage = getattr(plugin, "zero_stage", getattr(plugin, "stage", 0))
    if stage != 2 or getattr(plugin, "cpu_offload", False):
        return 0
    millions = getattr(
        plugin, "zero_bucket_size_in_m", getattr(plugin, "reduce_bucket_size_in_m", 0)
    )
    return int(min(float(millions) * 2**20, psi) * grad_bytes)


# [Note: the step's working memory]
# Measured (tools/calibrate_estimate.py, llama-medium on 2 ranks): where
# recomputation leaves little activation memory, FSDP2's peak is at the
# optimizer step, not in backward: AdamW's foreach path over DTensor shards
# holds temporaries of about 1.4 times the moments' bytes (78.2 MiB against
# 63.5 with foreach=False and 44.2 without a step): a measurement, not a
# derivation; the calibration table holds it. (Gemini's peak is below its
# states plus activations: [Note: Gemini's gradients at the peak] in
# pc_train.cost.)
_FOREACH_DTENSOR_STEP = 1.4


def step_working_bytes(options: PluginOptions, optimizer_bytes: float) -> float:
    """The optimizer step's working memory on the device."""
    if options.kind is PluginKind.FSDP:
        return _FOREACH_DTENSOR_STEP * optimizer_bytes
    return 0.0


# [Note: FSDP2's gathered blocks]
# FSDP2 holds whole the block it runs and the one it prefetches (its
# backward prefetch gathers the next block while this one computes): two
# blocks' parameters beyond the shards, at the backward's start where
# every activation is still kept. With full recomputation the activations
# are small, and the peak moves into backward: there a block's whole
# gradients and the reduce-scatter's copy of them are held beside the two
# gathered blocks. (Measured, tools/calibrate_estimate.py: without this
# term FSDP2 with full recomputation read 0.79-0.89 of the measured peak
# over 5 runs, the largest being the runs whose reduce-scatter finished
# after the next block's gradients existed.)


def fsdp_gathered_bytes(shape: ModelShape, options: PluginOptions, precision: str) -> int:
    """FSDP2's whole blocks in flight [Note: FSDP2's gathered blocks]."""
    if options.kind is not PluginKind.FSDP:
        return 0
    p = 4 if precision == "fp32" else 2
    block = max(shape.stage_params, default=0) / options.tp
    held = 2 * block * p
    if options.activation_checkpointing == "full":
        held += 2 * block * p
    return int(held)
