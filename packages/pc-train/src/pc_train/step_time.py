"""How long pc-estimate predicts a training step takes, in parts.

[Note: the step's time]
A step's seconds are the sum of what a rank does one after another:

- ``compute``: the model's FLOPs (6 per parameter per token, plus
  attention's) at the device's efficiency, over the ranks sharing them,
  with recomputation's extra forward;
- ``overhead``: a fixed cost per transformer block per micro-batch, the
  forward and backward's hundreds of small kernels whatever their size
  (``DeviceInfo.block_seconds``). A CPU runs them one after another, so it
  adds; a GPU launches them asynchronously, so it is a floor under the
  compute (the step is the larger of the two);
- ``collectives``: each collective call's fixed cost (``call_seconds``:
  latency, and on a CPU the wait for the slower rank that every
  synchronising call adds) times the calls a rank makes in a step
  (:func:`collective_calls`), plus their bytes at the link's bandwidth;
- ``optimizer``: Adam's pass over the rank's states, and 8-bit moments'
  quantisation per parameter (``int8_seconds_per_param``);
- ``offload``: states crossing to the host and the NVMe tier and back.

A pipeline multiplies the sum by its bubble (1F1B's (pp - 1) / m,
interleaved's half, zero bubble's third) and by its busiest stage's share
of the blocks. More ranks than cores (a CPU run of 4 ranks on 2 cores)
slow everything a rank does by ``ranks_per_core``.

The CPU constants are measured on the machine the calibration table runs
on (``tools/calibrate_estimate.py``: 26 layouts of a 1 M-parameter Llama on
2 and 4 ranks of a 2-core machine, each the median of 9 steps), by least
squares on the relative error of the step's seconds; docs/planner.md
shows the table before and after. The GPU's are a NCCL call's latency
within a node and no per-block cost beyond the compute (the kernels of a
block at the batch sizes the planner offers outlast their launches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pc_train.activations import BUBBLE_DIVISOR, COMPILED_TIME, RECOMPUTE_COST
from pc_train.options import PluginKind, PluginOptions

if TYPE_CHECKING:
    from pc_train.hardware import DeviceInfo
    from pc_train.network import Links
    from pc_train.shape import ModelShape

__all__ = [
    "BUCKET_BYTES",
    "StepTime",
    "collective_calls",
    "replicates_states",
    "step_flops",
    "step_time",
]

BUCKET_BYTES = 25 * 2**20  # the data-parallel gradient bucket (DDP's and ZeRO's default)
# Kernels of a block rerun by recomputation, as a share of its forward and
# backward's (a whole forward is about a third of them; selective reruns
# the attention's).
_RECOMPUTED_KERNELS = {"none": 0.0, "full": 1 / 3, "selective": 1 / 3}
# Zero bubble splits each block's backward into an input-gradient and a
# weight-gradient pass, launched separately: a third more of the block's.
_SPLIT_BACKWARD_KERNELS = 1 / 3
# Torch FSDP2 surrounds each gather with a copy in and a copy out and each
# reduce-scatter with a copy in: counted as calls, each as costly.
_FSDP_COPIES_PER_UNIT = 3


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, in the parts [Note: the step's time] names."""

    compute: float
    overhead: float
    collectives: float
    optimizer: float
    offload: float
    # The pipeline's factor (bubble and busiest stage), 1.0 without one.
    pipeline: float = 1.0
    # Overhead adds (a CPU), or is a floor under the compute (a GPU).
    overhead_adds: bool = True

    @property
    def seconds(self) -> float:
        if self.overhead_adds:
            work = self.compute + self.overhead
        else:
            work = max(self.compute, self.overhead)
        return (work + self.collectives + self.optimizer + self.offload) * self.pipeline


def replicates_states(options: PluginOptions) -> bool:
    """Whether every data-parallel rank keeps and steps the whole of its
    model part's optimizer states (DDP, hybrid without ZeRO) rather than a
    shard of them."""
    return options.kind is PluginKind.DDP or (
        options.kind is PluginKind.HYBRID and options.zero_stage == 0
    )


def step_flops(
    shape: ModelShape, options: PluginOptions, world: int, micro_batch: int, seq_len: int
) -> tuple[int, float]:
    """The tokens of one step over all ranks, and the FLOPs they cost (6 per
    parameter per token, plus attention's)."""
    micro = (options.microbatches or options.pp) if options.pp > 1 else 1
    tokens = micro_batch * seq_len * options.dp_size(world) * micro
    return tokens, (6 * shape.params + 12 * shape.layers * shape.hidden * seq_len) * tokens


def collective_calls(
    shape: ModelShape, options: PluginOptions, world: int, grad_bytes: float
) -> float:
    """Collective calls one rank makes in a step, each synchronising with
    its peers: the data-parallel ones per gradient bucket (ZeRO-3: three
    per block and three for the rest of the model; torch FSDP2's copies in
    and out as many again), and per block and micro-batch the
    tensor-parallel all-reduces (two each way; with sequence parallelism an
    all-gather and a reduce-scatter for each), Ulysses' all-to-alls (four
    each way) or ring attention's exchanges (keys and values forward, and
    their gradients back, sp - 1 of each), and a pipeline's sends and
    receives. (Counted as latency-bound rounds instead, 2 (k - 1) for a
    ring all-reduce over k ranks, the calibration table fitted worse:
    more rows beyond 25 %.)"""
    blocks = max(options.rank_blocks(shape.layers))
    micro = (options.microbatches or options.pp) if options.pp > 1 else 1
    calls = 0.0
    if options.tp > 1:
        # Two all-reduces forward and two backward a block (with sequence
        # parallelism each is an all-gather and a reduce-scatter), and the
        # vocabulary's.
        per_block = 8 if options.sequence_parallel else 4
        calls += (per_block * blocks + 4) * micro
    if options.sp > 1:
        per_block = 8 if options.sp_mode == "all_to_all" else 4 * (options.sp - 1)
        calls += per_block * blocks * micro
    if options.pp > 1:  # an activation forward and a gradient back, per micro-batch and chunk
        calls += 2 * micro * options.model_chunks
    n = options.dp_size(world) * options.sp
    if n > 1:
        buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
        if options.config().gathers_parameters:
            calls += 3 * (blocks + 1)
            if options.kind is PluginKind.FSDP:
                calls += _FSDP_COPIES_PER_UNIT * (blocks + 1)
        elif replicates_states(options):
            calls += buckets  # one all-reduce each
        else:
            calls += 2 * buckets  # a reduce-scatter and an all-gather each
        if options.extra_dp > 1:
            calls += buckets  # the all-reduce across the groups
    return calls


def step_time(
    shape: ModelShape,
    options: PluginOptions,
    world: int,
    micro_batch: int,
    seq_len: int,
    device: DeviceInfo,
    links: Links,
    *,
    param_bytes: int,
    grad_bytes: int,
    stepped_params: float,
    host_bytes: float,
    disk_bytes: float,
) -> StepTime:
    """The parts of one step's time [Note: the step's time]. ``stepped_params``:
    the parameters this rank's optimizer steps (its shard)."""
    psi = shape.per_rank(options)
    n = options.dp_size(world)
    micro = (options.microbatches or options.pp) if options.pp > 1 else 1
    blocks = max(options.rank_blocks(shape.layers))
    slow = device.ranks_per_core
    _, flops = step_flops(shape, options, world, micro_batch, seq_len)
    compute = flops / world / (device.peak_flops * device.efficiency)
    compute *= 1 + RECOMPUTE_COST[options.activation_checkpointing] * (
        options.activation_checkpointing_fraction
    )
    if options.compile:
        compute *= COMPILED_TIME
    rerun = _RECOMPUTED_KERNELS[options.activation_checkpointing]
    rerun *= options.activation_checkpointing_fraction
    if options.pp > 1 and options.pp_style == "zbv":
        rerun += _SPLIT_BACKWARD_KERNELS
    overhead = device.block_seconds * blocks * micro * (1 + rerun)
    gathers = options.config().gathers_parameters
    units = 3 if gathers else 2  # ZeRO-3 gathers twice and reduces once
    comm = links.data_parallel_seconds(
        units, psi * (param_bytes if gathers else grad_bytes), n, options.extra_dp > 1, device
    )
    moved = 0.0
    if options.tp > 1:
        per_layer = 8 * (options.tp - 1) / options.tp * micro_batch * seq_len * shape.hidden
        moved += per_layer * param_bytes * blocks * micro
    if options.sp > 1:  # Ulysses: four all-to-alls of 1/sp of the tokens a layer, each way
        sp = options.sp
        per_layer = 8 * (sp - 1) / sp * micro_batch * seq_len * shape.hidden / sp
        moved += per_layer * param_bytes * blocks * micro
    calls = collective_calls(shape, options, world, psi * grad_bytes)
    collectives = 0.5 * comm + moved / device.bandwidth + calls * device.call_seconds
    # Adam reads and writes its states and the parameter, and reads the
    # gradient (28 bytes a parameter in fp32), at the device's memory
    # bandwidth; 8-bit moments are quantised a block at a time on top.
    optimizer = stepped_params * 28 / device.memory_bandwidth
    if options.optimizer_states == "int8":
        optimizer += stepped_params * device.int8_seconds_per_param
    # Offloaded shards cross PCIe (about 25 GB/s) and step on the host
    # (about 10 GB/s); the NVMe tier's are read and written at the disk's.
    offload = 2 * host_bytes / 25e9 + host_bytes / 10e9
    offload += 2 * disk_bytes / device.disk_bandwidth + disk_bytes / 10e9
    pipeline = 1.0
    if options.pp > 1:
        # A rank idle in the bubble leaves its core to the others: the
        # bubble is not slowed by sharing the cores.
        pipeline = slow + (options.pp - 1) / micro / BUBBLE_DIVISOR[options.pp_style]
        pipeline *= blocks / (shape.layers / options.pp)  # the busiest rank sets the pace
        slow = 1.0
    return StepTime(
        compute * slow,
        overhead * slow,
        collectives * slow,
        optimizer * slow,
        offload,
        pipeline,
        overhead_adds=device.kind == "cpu",
    )
