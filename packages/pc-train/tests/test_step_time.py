"""pc-estimate's step time in parts ([Note: the step's time] in
pc_train.step_time): each part moves with what it counts, and only that."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pc_train.cost import ModelShape, estimate
from pc_train.hardware import DeviceInfo
from pc_train.network import Links
from pc_train.options import PluginKind, PluginOptions
from pc_train.step_time import StepTime, collective_calls, step_time

K = PluginKind
SHAPE = ModelShape(
    params=1_000_000, hidden=128, layers=4, heads=4, vocab=256, tp_sharded=990_000,
    stage_params=(240_000,) * 4, embed_params=32_768, head_params=32_768,
)  # fmt: skip
CPU = DeviceInfo(
    "cpu", 2**34, 1e11, 2e9, 0.5, block_seconds=4e-3, call_seconds=2e-3,
    memory_bandwidth=1e10, int8_seconds_per_param=1.5e-7,
)  # fmt: skip


def _time(options: PluginOptions, world: int = 2, device: DeviceInfo = CPU) -> StepTime:
    return step_time(
        SHAPE, options, world, 2, 128, device, Links(), param_bytes=4, grad_bytes=4,
        stepped_params=SHAPE.params / world, host_bytes=0, disk_bytes=0,
    )  # fmt: skip


def test_each_collective_call_is_counted_where_it_is_made() -> None:
    blocks = SHAPE.layers
    assert collective_calls(SHAPE, PluginOptions(K.DDP), 2, 4e6) == 1
    assert collective_calls(SHAPE, PluginOptions(K.DDP), 2, 60 * 2**20) == 3  # 25 MiB buckets
    assert collective_calls(SHAPE, PluginOptions(K.ZERO2), 2, 4e6) == 2
    assert collective_calls(SHAPE, PluginOptions(K.GEMINI), 2, 4e6) == 3 * (blocks + 1)
    assert collective_calls(SHAPE, PluginOptions(K.FSDP), 2, 4e6) == 6 * (blocks + 1)
    tp = PluginOptions(K.HYBRID, tp=2, zero_stage=0)
    assert collective_calls(SHAPE, tp, 2, 4e6) == 4 * blocks + 4  # dp 1: none of its own
    # Sequence parallelism: an all-gather and a reduce-scatter for each all-reduce.
    assert collective_calls(SHAPE, replace(tp, sequence_parallel=True), 2, 4e6) == 8 * blocks + 4
    ulysses = PluginOptions(K.HYBRID, sp=2, zero_stage=1)
    assert collective_calls(SHAPE, ulysses, 2, 4e6) == 8 * blocks + 2
    pp = PluginOptions(K.HYBRID, pp=2, zero_stage=0, microbatches=4)
    assert collective_calls(SHAPE, pp, 2, 4e6) == 2 * 4
    assert collective_calls(SHAPE, replace(pp, pp_style="interleaved"), 2, 4e6) == 2 * 4 * 2
    assert collective_calls(SHAPE, PluginOptions(K.ZERO2, extra_dp=2), 4, 4e6) == 3


def test_a_slower_call_slows_the_layouts_that_call_more() -> None:
    slow_calls = replace(CPU, call_seconds=2 * CPU.call_seconds)
    grew = {
        kind: _time(PluginOptions(kind), device=slow_calls).seconds
        - _time(PluginOptions(kind)).seconds
        for kind in (K.DDP, K.ZERO2, K.GEMINI, K.FSDP)
    }
    assert grew[K.DDP] < grew[K.ZERO2] < grew[K.GEMINI] < grew[K.FSDP]
    assert grew[K.DDP] == pytest.approx(CPU.call_seconds)


def test_more_ranks_than_cores_slow_everything_but_the_bubble() -> None:
    ddp = PluginOptions(K.DDP)
    shared = replace(CPU, ranks_per_core=2.0)
    assert _time(ddp, device=shared).seconds == pytest.approx(2 * _time(ddp).seconds)
    pp = PluginOptions(K.HYBRID, pp=2, zero_stage=0, microbatches=2)
    alone, crowded = _time(pp), _time(pp, device=shared)
    # 1F1B over 2 micro-batches: a bubble of half the work, not slowed.
    assert alone.pipeline == pytest.approx(1.5)
    assert crowded.pipeline == pytest.approx(2.5)


def test_a_gpu_hides_launches_behind_compute_and_a_cpu_adds_them() -> None:
    ddp = PluginOptions(K.DDP)
    cpu = _time(ddp)
    gpu = _time(ddp, device=replace(CPU, kind="cuda"))
    assert cpu.seconds - gpu.seconds == pytest.approx(min(cpu.compute, cpu.overhead))
    assert cpu.overhead == pytest.approx(CPU.block_seconds * SHAPE.layers)


def test_recomputation_and_split_backward_launch_more() -> None:
    base = _time(PluginOptions(K.ZERO2)).overhead
    assert _time(PluginOptions(K.ZERO2, activation_checkpointing="full")).overhead == (
        pytest.approx(base * 4 / 3)
    )
    pp = PluginOptions(K.HYBRID, pp=2, zero_stage=1, microbatches=2)
    assert _time(replace(pp, pp_style="zbv")).overhead == pytest.approx(_time(pp).overhead * 4 / 3)


def test_eight_bit_moments_cost_their_quantisation_per_stepped_parameter() -> None:
    wide = _time(PluginOptions(K.ZERO2)).optimizer
    narrow = _time(PluginOptions(K.ZERO2, optimizer_states="int8")).optimizer
    assert narrow - wide == pytest.approx(SHAPE.params / 2 * CPU.int8_seconds_per_param)


def test_the_estimate_reports_the_parts_sum() -> None:
    options = PluginOptions(K.HYBRID, tp=2, zero_stage=1)
    result = estimate(SHAPE, options, 2, 2, 128, "fp32", CPU)
    parts = step_time(
        SHAPE, options, 2, 2, 128, CPU, Links(), param_bytes=4, grad_bytes=4,
        stepped_params=SHAPE.per_rank(options), host_bytes=0, disk_bytes=0,
    )  # fmt: skip
    assert result.step_seconds == pytest.approx(parts.seconds)
    assert result.exposed_comm_seconds == pytest.approx(parts.collectives)
