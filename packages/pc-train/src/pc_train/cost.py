"""The cost model behind ``pc-estimate`` and ``--plugin auto``: a model's
shape (:func:`model_shape`, counted on the meta device), the per-rank
memory and step time of each plugin (:func:`estimate`), the plugin to use
with its reasons (:func:`recommend`), and the model states a rank holds,
measured from its tensors (:func:`measured_model_state_bytes`).

Model states follow the ZeRO paper's accounting for Adam (at the step,
gradients held), with Ψ the
parameters a rank's model part holds (after tensor and pipeline
parallelism) and N the data-parallel ranks. A parameter costs ``p`` bytes
(4 in fp32, 2 under fp16/bf16), its gradient ``g`` bytes, an fp32 master
``m`` bytes (4 under mixed precision, 0 in fp32: the parameter is its own
master) and Adam's two moments 8 bytes:

========  ===================================
ddp       (p + g + m + 8) Ψ
zero1     (p + g) Ψ + (g + m + 8) Ψ / N
zero2     p Ψ + (g + m + 8) Ψ / N
fsdp      16 Ψ / N (fp32 shards; bf16 only in compute)
gemini    (p + g + m + 8) Ψ / N, chunks padded
========  ===================================

Activations use Korthikanti et al.'s per-layer count (``s b h (34 + 5 a
s / h)`` bytes in 16-bit, twice that in fp32; tensor parallelism divides
the parts it shards), plus the logits. Step time is the model FLOPs (6Ψ
per token plus attention) at a fraction of the device's peak, plus the
communication not hidden behind backward. Memory is the number to trust
(checked against measured runs within 10%); time is a first guess.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.rules import StateBytes, TrainPrecision
from pc_train.activations import (
    activation_bytes,
    bucket_in_flight,
    fsdp_gathered_bytes,
    step_working_bytes,
)
from pc_train.hardware import DeviceInfo, GiB
from pc_train.models import ModelSpec, build_model
from pc_train.network import Links
from pc_train.options import PluginKind, PluginOptions
from pc_train.shape import ModelShape
from pc_train.step_time import replicates_states, step_flops, step_time

__all__ = [
    "Estimate",
    "Links",
    "ModelShape",
    "Recommendation",
    "estimate",
    "measured_model_state_bytes",
    "model_shape",
    "recommend",
]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def model_shape(spec: ModelSpec) -> ModelShape:
    """Count the model's parameters on the meta device (no memory)."""
    from pc_tensor import policy_for

    # From the config alone: a pretrained directory's weights are not read.
    model = build_model(replace(spec, pretrained=None), seed=0, device="meta")
    params = _numel(model)
    base = getattr(model, "base_model", model)
    try:  # the family's transformers plan, or pc's own policy
        policy = policy_for(model)
    except (ValueError, TypeError):
        policy = None
    sharded = 0
    blocks: list[nn.Module] = []
    if policy is not None:
        blocks = list(operator.attrgetter(policy.blocks)(base))
        seen: set[int] = set()
        modules = [operator.attrgetter(policy.embedding)(base)]
        lm_head = policy.lm_heads.get(type(model).__name__)
        if lm_head is not None:
            modules.append(operator.attrgetter(lm_head)(model))
        for block in blocks:
            modules += [operator.attrgetter(path)(block) for path in policy.column]
            for path in policy.row:
                weight = operator.attrgetter(path)(block).weight
                if id(weight) not in seen:
                    seen.add(id(weight))
                    sharded += weight.numel()
        for module in modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    sharded += param.numel()
    layers: list[nn.Module] = []
    try:  # the pipeline's layers, where pipelines support the family
        from pc_booster.pipeline import pipeline_layers

        layers, _ = pipeline_layers(model)
    except (TypeError, ValueError):
        pass
    if not blocks and len(layers) > 2:  # no tp plan (mixture of experts): the pipeline's blocks
        blocks = layers[1:-1]
    per_block = tuple(_numel(b) for b in blocks) or (params,)
    embed, head = params - sum(per_block), 0
    if layers:
        embed, head = _numel(layers[0]), _numel(layers[-1])
    config = spec.config
    heads = int(getattr(config, "num_attention_heads", getattr(config, "n_head", 1)))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    from pc_tensor import find_experts

    try:
        found = [m for _, m in find_experts(model)]
    except ValueError:  # experts pc cannot split: counted as dense
        found = []
    experts = sum(_numel(m) for m in found)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if found else 0
    count = int(getattr(found[0], "num_experts", 0) or 0) if found else 0
    # A gated expert holds three hidden x ffn matrices.
    ffn = _numel(found[0]) // max(count * 3 * spec.hidden, 1) if found else 0
    return ModelShape(
        params=params,
        hidden=spec.hidden,
        layers=len(per_block),
        heads=heads,
        kv_heads=kv_heads,
        vocab=spec.vocab_size,
        tp_sharded=sharded,
        stage_params=per_block,
        embed_params=embed,
        head_params=head,
        expert_params=experts,
        moe_layers=len(found),
        top_k=top_k,
        expert_ffn=ffn,
        experts=count,
    )


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank figures for one plugin."""

    plugin: str
    world: int
    params: int
    params_per_rank: int
    parameter_bytes: int
    gradient_bytes: int
    master_bytes: int
    optimizer_bytes: int
    host_bytes: int
    activation_bytes: int
    flops_per_step: float
    step_seconds: float
    tokens_per_step: int
    fits: bool
    # The data-parallel collectives' share of step_seconds (not hidden behind compute).
    exposed_comm_seconds: float = 0.0
    # Working memory of the optimizer step [Note: the step's working memory].
    step_bytes: int = 0
    gathers_parameters: bool = False
    # Adam's moments as a checkpoint holds them: fp32, however they are
    # stored (narrow moments are widened for a save); 0: optimizer_bytes.
    saved_optimizer_bytes: int = 0
    # Gradient bytes not yet held at the activations' peak [Note: Gemini's
    # gradients at the peak].
    gradients_after_peak: int = 0
    # Adam's moments on the NVMe tier (not in host_bytes), and whether the
    # host holds the rest (a CPU rank's host is its device memory).
    disk_bytes: int = 0
    host_fits: bool = True
    device_fits: bool = True
    host_is_device: bool = False  # a CPU rank: one memory

    @property
    def model_state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def device_bytes(self) -> int:
        """The peak: in backward (states and activations) or at the
        optimizer step (states and the step's working memory)."""
        working = max(self.activation_bytes - self.gradients_after_peak, self.step_bytes)
        elsewhere = self.disk_bytes + (0 if self.host_is_device else self.host_bytes)
        return self.model_state_bytes - elsewhere + working

    @property
    def async_save_bytes(self) -> int:
        """Host memory an async sharded save holds until written: a copy of
        this rank's share of the fp32 values and Adam's moments (12 bytes
        per parameter it keeps optimizer states for). A synchronous sharded
        save writes from the plugin's own tensors and adds nothing."""
        return (self.saved_optimizer_bytes or self.optimizer_bytes) * 3 // 2

    @property
    def full_save_bytes(self) -> int:
        """Host memory the full (unsharded) form gathers on every rank: the
        whole model's fp32 values and Adam moments."""
        return 12 * self.params


def estimate(
    spec: ModelSpec | ModelShape,
    options: PluginOptions,
    world: int,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    device: DeviceInfo | None = None,
    links: Links | None = None,
) -> Estimate:
    """Per-rank memory and step time of ``spec`` trained with ``options``
    on ``world`` ranks, ``micro_batch`` sequences of ``seq_len`` per
    data-parallel rank (per micro-batch for pipelines). ``links``: the
    nodes and the bandwidth between them (default: one node, every
    collective at ``device.bandwidth``)."""
    shape = spec if isinstance(spec, ModelShape) else model_shape(spec)
    device = device or DeviceInfo.detect(world, precision)
    psi = shape.per_rank(options)
    n = options.dp_size(world)
    p = 2 if precision != "fp32" else 4
    g = p
    plugin = options.config()
    # The plugin states its own memory model; ZeRO shards over the data-
    # and sequence-parallel ranks together.
    states = plugin.model_states(psi, n * options.sp, TrainPrecision.parse(precision))
    if options.ep > 1 and shape.expert_params:
        # [Note: expert-parallel optimizer]: dense states over the data-
        # parallel ranks, the experts' over the ranks holding the same ones.
        local = shape.experts_per_rank(options)
        dense = plugin.model_states(psi - local, n, TrainPrecision.parse(precision))
        expert = plugin.model_states(
            local, max(n // options.ep, 1), TrainPrecision.parse(precision)
        )
        states = StateBytes(
            dense.parameters + expert.parameters,
            dense.gradients + expert.gradients,
            dense.masters + expert.masters,
            dense.optimizer + expert.optimizer,
            dense.host + expert.host,
            dense.disk + expert.disk,
        )
    params, grads = states.parameters, states.gradients
    master, host = states.masters, states.host
    states_bytes = states.optimizer
    activations = activation_bytes(
        shape, options, micro_batch, seq_len, precision, fused_attention=device.kind == "cuda"
    )
    activations += bucket_in_flight(plugin, psi, g)
    activations += fsdp_gathered_bytes(shape, options, precision)
    tokens, flops = step_flops(shape, options, world, micro_batch, seq_len)
    sharded = plugin.gathers_parameters or not replicates_states(options)
    timing = step_time(
        shape, options, world, micro_batch, seq_len, device, links or Links(),
        param_bytes=p, grad_bytes=g, stepped_params=psi / (n * options.sp) if sharded else psi,
        host_bytes=host, disk_bytes=states.disk,
    )  # fmt: skip
    seconds = timing.seconds
    # A checkpoint holds fp32 moments however they are stored (saves widen
    # narrow ones): the same plugin's fp32 count.
    saved_moments = states_bytes
    if options.optimizer_states != "fp32":
        wide = replace(options, optimizer_states="fp32").config()
        saved_moments = wide.model_states(
            psi, n * options.sp, TrainPrecision.parse(precision)
        ).optimizer
    # [Note: Gemini's gradients at the peak]
    # Gemini's gradient shards are made in backward, chunk by chunk, as the
    # activations are freed, and the step frees them: at the activations'
    # peak (backward's start) a rank holds none. Measured
    # (tools/calibrate_estimate.py, llama-small / llama-medium on 2 ranks):
    # states plus activations over-predicted the peak by 7-13 %; without the
    # gradients, 3-6 % under. Over tensor parallelism (Gemini tp2 on 4
    # ranks) the peak holds them: without them 0.89-0.93 of the measured
    # peak, with them 0.94-1.01, so they are kept there (measured, not
    # derived). (An earlier term here added 4 bytes per shard parameter,
    # measured while every revisited chunk stayed gathered through forward:
    # pc_chunk's [Note: releasing and prefetching].)
    after_peak = grads if options.kind is PluginKind.GEMINI and options.tp == 1 else 0.0
    device_bytes = params + grads + master + states_bytes - host - states.disk
    device_bytes += max(activations - after_peak, 0)
    if device.kind == "cpu":  # one memory: what is "on the host" is there too
        device_bytes += host
    host_limit = None if device.kind == "cpu" else device.host_memory_bytes
    device_fits = device_bytes <= 0.9 * device.memory_bytes
    host_fits = host_limit is None or host <= 0.9 * host_limit
    return Estimate(
        plugin=options.describe(),
        world=world,
        params=shape.params,
        params_per_rank=psi,
        parameter_bytes=int(params),
        gradient_bytes=int(grads),
        master_bytes=int(master),
        optimizer_bytes=int(states_bytes),
        host_bytes=int(host),
        activation_bytes=activations,
        flops_per_step=float(flops),
        step_seconds=seconds,
        tokens_per_step=tokens,
        fits=device_fits and host_fits,
        host_fits=host_fits,
        device_fits=device_fits,
        disk_bytes=int(states.disk),
        host_is_device=device.kind == "cpu",
        exposed_comm_seconds=timing.collectives * timing.pipeline,
        step_bytes=int(step_working_bytes(options, states_bytes - host)),
        gathers_parameters=plugin.gathers_parameters,
        gradients_after_peak=int(after_peak),
        saved_optimizer_bytes=int(saved_moments),
    )


@dataclass(frozen=True)
class Recommendation:
    options: PluginOptions
    reasons: tuple[str, ...]
    estimates: tuple[Estimate, ...] = field(default=())


def gib_text(nbytes: float) -> str:
    """``nbytes`` in GiB (MiB below one GiB), for tables and reasons."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def _accepts(options: PluginOptions, world: int, precision: str) -> bool:
    """Whether the plugin's own rules accept a run of ``precision`` on
    ``world`` ranks (what else they check is not known yet)."""
    try:
        options.check(world, precision)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class _Run:
    """The run :func:`recommend` chooses a plugin for: its estimate under
    each candidate, and the words its reasons share."""

    shape: ModelShape
    world: int
    micro_batch: int
    seq_len: int
    precision: str
    device: DeviceInfo

    def estimate(self, options: PluginOptions) -> Estimate:
        return estimate(
            self.shape, options, self.world, self.micro_batch, self.seq_len, self.precision,
            self.device,
        )  # fmt: skip

    @property
    def budget(self) -> str:
        return f"{gib_text(0.9 * self.device.memory_bytes)} usable per rank ({self.device.kind})"

    def fits_text(self, result: Estimate) -> str:
        return (
            f"{result.plugin}: model states {gib_text(result.model_state_bytes)} + activations "
            f"{gib_text(result.activation_bytes)} per rank fit in {self.budget}."
        )


def recommend(
    spec: ModelSpec | ModelShape,
    world: int,
    micro_batch: int,
    seq_len: int,
    precision: str = "fp32",
    device: DeviceInfo | None = None,
    step_in_backward: bool = False,
) -> Recommendation:
    """The plugin to train with (see the plugin-selection guide): ZeRO-2
    when its model states and activations fit the device (DDP's
    communication volume, a fraction of its memory, measured fastest here),
    then ZeRO-3 (Gemini), then Gemini with chunks offloaded to the host.
    One process trains plainly (ddp, which then wraps nothing).

    ``step_in_backward=True`` says the training can do without global-norm
    clipping and gradient accumulation (and is not fp16): then, when plain
    Gemini does not fit, Gemini stepping in backward (12 bytes per
    parameter of model states instead of 16) is tried before offloading,
    and offloads less when it must. Without it, the reasons say what it
    would save."""
    shape = spec if isinstance(spec, ModelShape) else model_shape(spec)
    device = device or DeviceInfo.detect(world, precision)
    run = _Run(shape, world, micro_batch, seq_len, precision, device)
    # Only the plugins whose rules accept this run.
    kinds = [
        kind
        for kind in (PluginKind.DDP, PluginKind.ZERO2, PluginKind.GEMINI)
        if _accepts(PluginOptions(kind), world, precision)
    ]
    results = {kind: run.estimate(PluginOptions(kind)) for kind in kinds}
    table = tuple(results.values())
    if world == 1 and PluginKind.DDP in results and results[PluginKind.DDP].fits:
        reason = "one process: nothing to shard or communicate; " + run.fits_text(
            results[PluginKind.DDP]
        )
        return Recommendation(PluginOptions(PluginKind.DDP), (reason,), table)
    zero2, gemini = results[PluginKind.ZERO2], results[PluginKind.GEMINI]
    if zero2.fits:
        reasons = [run.fits_text(zero2)]
        if PluginKind.DDP in results:
            ddp = results[PluginKind.DDP]
            reasons.append(
                f"ZeRO-2 communicates as much as DDP (reduce-scatter + all-gather instead of one "
                f"all-reduce) and holds {gib_text(zero2.model_state_bytes)} of model states "
                f"instead of DDP's {gib_text(ddp.model_state_bytes)}; it measured faster than DDP "
                "on this project's benchmark (each rank steps only its share of the optimizer)."
            )
        return Recommendation(PluginOptions(PluginKind.ZERO2), tuple(reasons), table)
    if gemini.fits:
        reasons = [
            run.fits_text(gemini),
            f"zero2 would need {gib_text(zero2.device_bytes)} per rank; ZeRO-3 shards the "
            "parameters too, at 1.5x DDP's communication (Gemini gathers each chunk once per "
            "pass, and was faster than FSDP2 on this project's benchmark).",
        ]
        return Recommendation(PluginOptions(PluginKind.GEMINI), tuple(reasons), table)
    return _beyond_gemini(run, gemini, table, step_in_backward)


def _beyond_gemini(
    run: _Run, gemini: Estimate, table: tuple[Estimate, ...], step_in_backward: bool
) -> Recommendation:
    """:func:`recommend` where plain Gemini does not fit the device: Gemini
    stepping in backward (when allowed and it fits), else Gemini with the
    share of its chunks offloaded to the host that makes it fit."""
    world, precision = run.world, run.precision
    spare = 0.9 * run.device.memory_bytes - gemini.activation_bytes
    if spare <= 0:
        raise ValueError(
            f"the activations alone ({gib_text(gemini.activation_bytes)} per rank) exceed "
            f"{run.budget}; lower the micro-batch or the sequence length, or use --plugin "
            "hybrid with --tp > 1."
        )
    needs = "it needs --clip-norm 0 and --accumulation 1 (each chunk steps before the others' "
    needs += "gradients exist), with the same update as stepping after backward"
    in_bwd = None
    in_bwd_options = PluginOptions(PluginKind.GEMINI, step_in_backward=True)
    if _accepts(in_bwd_options, world, precision):  # not fp16: an overflow found late
        in_bwd = run.estimate(in_bwd_options)
    if step_in_backward and in_bwd is not None and in_bwd.fits:
        reasons = [
            run.fits_text(in_bwd),
            f"gemini would need {gib_text(gemini.device_bytes)} per rank; stepping each chunk "
            "inside backward keeps no gradient shard (12 bytes per parameter of model states "
            f"instead of 16), so nothing goes to the host; {needs}.",
        ]
        return Recommendation(in_bwd_options, tuple(reasons), (*table, in_bwd))

    def host_share(base: Estimate) -> float:
        return min(1.0, math.ceil(20 * (1 - spare / base.model_state_bytes)) / 20)

    base = in_bwd if step_in_backward and in_bwd is not None else gemini
    use_in_bwd = base is in_bwd
    frac = host_share(base)
    options = PluginOptions(PluginKind.GEMINI, offload_frac=frac, step_in_backward=use_in_bwd)
    offloaded = run.estimate(options)
    reasons = [
        f"nothing fits in {run.budget} on the device alone: {base.plugin} needs "
        f"{gib_text(base.device_bytes)} per rank.",
        f"{options.describe()}: {frac:.0%} of the chunks live on the host "
        f"({gib_text(offloaded.host_bytes)} per rank), stepped there by the CPU optimizer.",
    ]
    if use_in_bwd:
        reasons.append(f"stepping in backward keeps 12 bytes per parameter instead of 16; {needs}.")
    elif in_bwd is not None:  # say what the user would gain by giving up clipping
        other = host_share(in_bwd) if not in_bwd.fits else 0.0
        where = f"{other:.0%} of the chunks on the host" if other else "nothing on the host"
        reasons.append(
            f"--step-in-backward (12 bytes per parameter of model states instead of 16) would "
            f"need {where}; {needs}."
        )
    return Recommendation(options, tuple(reasons), (*table, offloaded))


def measured_model_state_bytes(model: nn.Module, optimizer: Optimizer) -> int:
    """Bytes of model states this rank holds now, counted from the tensors:
    the ZeRO and Gemini wrappers' own accounting, else the parameters, their
    gradients and the optimizer's states (local shards of DTensors), each
    tensor once and by its own elements (a shared-memory gradient bucket's
    storage spans every rank's buffer)."""
    if hasattr(optimizer, "memory"):
        return int(optimizer.memory().total)
    wrapper: Any = model
    if hasattr(wrapper, "chunks") and hasattr(wrapper, "memory"):  # Gemini (a pipeline
        return int(wrapper.memory(optimizer).total)  # has chunks too: its micro-batches)
    seen: dict[int, int] = {}

    def count(tensors: Any) -> None:
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.numel():
                seen[local.data_ptr()] = local.numel() * local.element_size()

    inner = getattr(optimizer, "inner", optimizer)
    parts: tuple[Any, ...] = inner.parts() if hasattr(inner, "parts") else (inner,)
    if len(parts) > 1 and all(hasattr(part, "memory") for part in parts):  # ep: ZeRO twice
        return int(sum(part.memory().total for part in parts))
    params = list(model.parameters())
    count(params)
    count(p.grad for p in params if p.grad is not None)
    for part in parts:
        count(v for s in part.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return sum(seen.values())
