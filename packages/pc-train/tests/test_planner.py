"""pc-estimate's planner [Note: the planner] and the pc-train flags it
writes: every plan is one the plugins' rules accept, fits the device, and
round-trips through pc-train's command line; plans are ranked by
predicted throughput; layouts beyond data parallelism appear where data
parallelism does not fit; the options pc-train gained (tp for ZeRO-3,
two-level sharding, recomputation, compile) reach the plugin."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from pc_train.cost import Links, estimate, model_shape
from pc_train.hardware import gpu_device
from pc_train.models import resolve_model
from pc_train.options import PluginKind, PluginOptions
from pc_train.planner import NEAR, Cluster, rank, search
from pc_train.train_config import parse_args


@pytest.fixture(scope="module")
def llama13b_plans() -> list:  # type: ignore[type-arg]
    shape = model_shape(resolve_model("llama-13b", 4096))
    cluster = Cluster(2, 8, gpu_device("H100", "bf16"), 50e9)
    return search(shape, cluster, 64, 4096, "bf16")


def test_plans_fit_are_accepted_and_ranked(llama13b_plans: list) -> None:  # type: ignore[type-arg]
    plans = llama13b_plans
    assert len(plans) > 20
    rates = [p.tokens_per_second for p in plans]
    assert rates[1:] == sorted(rates[1:], reverse=True)
    near = [p for p in plans if p.tokens_per_second >= (1 - NEAR) * max(rates)]
    assert plans[0].order == min(p.order for p in near)  # the first searched of the near
    budget = 0.9 * gpu_device("H100", "bf16").memory_bytes
    for plan in plans:
        assert plan.estimate.device_bytes <= budget
        plan.options.check(16, "bf16", 40, accumulation=plan.accumulation, heads=40)


def test_every_axis_is_searched(llama13b_plans: list) -> None:  # type: ignore[type-arg]
    seen = {p.options.kind for p in llama13b_plans}
    assert {PluginKind.ZERO2, PluginKind.GEMINI, PluginKind.HYBRID} <= seen
    options = [p.options for p in llama13b_plans]
    assert any(o.tp > 1 and o.kind is PluginKind.FSDP for o in options)
    assert any(o.pp > 1 for o in options)
    assert any(o.sp > 1 for o in options)
    assert any(o.extra_dp > 1 for o in options)
    assert any(o.activation_checkpointing == "full" for o in options)
    assert any(o.sequence_parallel for o in options)


def test_a_model_data_parallelism_cannot_hold_gets_another_layout() -> None:
    """A 67 B-parameter Llama-like model on 16 H100s: DDP and ZeRO-1 keep
    whole bf16 parameters and gradients (2 x 134 GB), so only sharded or
    split layouts fit."""
    shape = model_shape(resolve_model("llama-7b", 4096))  # scaled ten times below
    cluster = Cluster(2, 8, gpu_device("H100", "bf16"), 50e9)
    big = replace(
        shape,
        params=shape.params * 10,
        tp_sharded=shape.tp_sharded * 10,
        stage_params=tuple(p * 10 for p in shape.stage_params),
    )
    plans = search(big, cluster, 64, 4096, "bf16")
    assert plans
    assert all(p.options.kind not in (PluginKind.DDP, PluginKind.ZERO1) for p in plans)


def test_plan_flags_round_trip_through_pc_train(llama13b_plans: list) -> None:  # type: ignore[type-arg]
    for plan in llama13b_plans[:40]:
        config = parse_args(["--model", "llama-13b", *shlex.split(plan.flags())])
        assert config.plugin_options() == plan.options, plan.flags()
        assert config.accumulation == plan.accumulation


def test_new_pc_train_options_reach_the_plugin() -> None:
    fsdp = PluginOptions(PluginKind.FSDP, tp=2, activation_checkpointing="selective", compile=True)
    config = fsdp.config()
    assert (config.tp_size, config.activation_checkpointing, config.compile) == (  # type: ignore[attr-defined]
        2, "selective", True,
    )  # fmt: skip
    gemini = PluginOptions(PluginKind.GEMINI, extra_dp=2).config()
    assert gemini.extra_dp_size == 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"--extra-dp 2 .* is an option of --plugin zero1"):
        PluginOptions(PluginKind.DDP, extra_dp=2).check_flags()
    with pytest.raises(ValueError, match="--tp hybrid, fsdp or gemini"):
        PluginOptions(PluginKind.ZERO2, tp=2).check_flags()
    with pytest.raises(ValueError, match="activation-checkpointing must be one of"):
        PluginOptions(PluginKind.DDP, activation_checkpointing="some").check_flags()


def test_two_level_sharding_moves_less_between_nodes_in_the_estimate() -> None:
    """The links model [Note: the planner]: ZeRO-3's gathers stay in the
    node under two-level sharding, so fewer bytes cross the slow link."""
    device = gpu_device("H100", "bf16")
    links = Links(nodes=4, inter_bandwidth=5e9)
    full = links.data_parallel_seconds(3, 1e9, 32, False, device)
    two_level = links.data_parallel_seconds(3, 1e9, 32, True, device)
    assert two_level < full
    one_node = Links().data_parallel_seconds(3, 1e9, 32, False, device)
    assert one_node == pytest.approx(3 * 31 / 32 * 1e9 / device.bandwidth)


def test_experts_and_offload_are_searched() -> None:
    """Mixtral 8x7B on 2 x 8 H100s: expert parallelism (ep dividing the
    data-parallel ranks and the 8 experts) appears among the plans, and
    the only expert-parallel plans are hybrid ones the rules accept; a
    dense model gets none."""
    shape = model_shape(resolve_model("mixtral-8x7b", 4096))
    assert shape.experts == 8
    cluster = Cluster(2, 8, gpu_device("H100", "bf16"), 50e9)
    plans = search(shape, cluster, 64, 4096, "bf16")
    split = [p.options for p in plans if p.options.ep > 1]
    assert split, "no expert-parallel plan"
    for options in split:
        assert options.kind is PluginKind.HYBRID
        assert 8 % options.ep == 0
        assert options.dp_size(16) % options.ep == 0
    dense = model_shape(resolve_model("llama-7b", 4096))
    assert not any(p.options.ep > 1 for p in search(dense, cluster, 64, 4096, "bf16"))


def test_offload_and_stepping_in_backward_where_they_are_needed() -> None:
    """A device that holds no plugin's model states: only offloaded plans
    fit (ZeRO's optimizer on the host, or the least share of Gemini's
    chunks that fits), and Gemini stepping in backward is a plan only when
    the run does not clip."""
    shape = model_shape(resolve_model("llama-7b", 4096))
    device = replace(gpu_device("H100", "bf16"), memory_bytes=int(40e9))
    cluster = Cluster(1, 2, device, 50e9)
    clipped = search(shape, cluster, 4, 4096, "bf16")
    assert clipped, "nothing fits with offload"
    for plan in clipped:
        assert plan.estimate.host_bytes > 0, plan.options.describe()
        assert not plan.options.step_in_backward
    assert any(p.options.cpu_offload for p in clipped)
    gemini = [p for p in clipped if p.options.kind is PluginKind.GEMINI]
    assert gemini
    for plan in gemini:  # the least share: 5 % less does not fit
        less = replace(plan.options, offload_frac=round(plan.options.offload_frac - 0.05, 2))
        assert not estimate(
            shape, less, 2, plan.micro_batch, 4096, "bf16", device, cluster.links
        ).fits
    unclipped = search(shape, cluster, 4, 4096, "bf16", max_norm=0.0)
    assert any(p.options.step_in_backward for p in unclipped)


def test_plugin_auto_keeps_the_recomputation_asked_for(tmp_path: object) -> None:
    """``--plugin auto --activation-checkpointing selective`` chooses among
    the plans with that recomputation and keeps the share of blocks given;
    without the flag the planner chooses the recomputation too."""
    from pc_train.train import prepare

    base = ["--model", "gpt2-tiny", "--plugin", "auto", "--nproc", "2", "--output-dir",
            str(tmp_path)]  # fmt: skip
    asked = ["--activation-checkpointing", "selective", "--activation-checkpointing-fraction",
             "0.5"]  # fmt: skip
    config, _, _ = prepare(parse_args([*base, *asked]), 2)
    assert config.activation_checkpointing == "selective"
    assert config.activation_checkpointing_fraction == 0.5
    config, _, _ = prepare(parse_args(base), 2)
    assert config.activation_checkpointing_fraction == 1.0


def test_moments_are_narrowed_only_where_fp32_does_not_fit() -> None:
    """Llama-7B on 8 devices of 26 GiB: ZeRO-2 does not fit with fp32
    moments at any micro-batch, and is planned with bf16 moments; every
    narrowed plan is the least narrowing that fits (fp32, and bf16 for an
    int8 plan, do not fit, Gemini's with all its chunks on the host), and
    only the plugins that store moments narrow on the device get one."""
    shape = model_shape(resolve_model("llama-7b", 4096))
    device = replace(gpu_device("H100", "bf16"), memory_bytes=26 * 2**30)
    cluster = Cluster(1, 8, device, 50e9)
    plans = search(shape, cluster, 8, 4096, "bf16")
    narrowed = [p for p in plans if p.options.optimizer_states != "fp32"]
    assert any(
        p.options.kind is PluginKind.ZERO2 and p.options.optimizer_states == "bf16"
        for p in narrowed
    ), [p.options.describe() for p in plans]
    assert not any(  # on the device, fp32 moments do not fit (the host's do)
        p.options.kind is PluginKind.ZERO2
        and p.options.optimizer_states == "fp32"
        and not p.options.cpu_offload
        for p in plans
    )
    for plan in narrowed:
        options = plan.options
        assert options.kind in (PluginKind.ZERO1, PluginKind.ZERO2, PluginKind.GEMINI)
        assert not options.cpu_offload
        wider = ["fp32", "bf16"] if options.optimizer_states == "int8" else ["fp32"]
        for states in wider:
            other = replace(options, optimizer_states=states)
            if other.kind is PluginKind.GEMINI and other.tp == 1:  # as the planner offloads
                other = replace(other, offload_frac=1.0)
            result = estimate(shape, other, 8, plan.micro_batch, 4096, "bf16", device)
            assert not result.fits, (options.describe(), states)
    # The flags round-trip through pc-train.
    flags = narrowed[0].flags()
    assert "--optimizer-states" in flags
    config = parse_args([*shlex.split(flags), "--model", "llama-7b"])
    assert config.optimizer_states == narrowed[0].options.optimizer_states


def test_the_disk_tier_is_planned_only_where_memory_cannot_hold_the_run() -> None:
    """On a CPU (one memory: offloading to the "host" frees nothing) too
    small for every layout with its moments in memory, even narrowed to 8
    bits, the plans keep a share of the moments on the NVMe tier: the least
    share (5 % less does not fit), fp32 or bf16 moments (8-bit ones stay in
    memory), accepted by the plugin's rules, and written as pc-train flags
    that parse back to the same options; a slower disk makes them slower."""
    from pc_train.hardware import DeviceInfo
    from pc_train.options import OPTIMIZER_STATES

    shape = model_shape(resolve_model("gpt2-small", 64))
    device = DeviceInfo("cpu", 4 * 2**20, 1e11, 2e9, 0.5)
    plans = search(shape, Cluster(1, 2, device), 4, 64, "fp32", max_norm=0.0)
    on_disk = [p for p in plans if p.options.nvme_offload_fraction]
    assert on_disk, [p.options.describe() for p in plans]
    for plan in on_disk:
        o, micro = plan.options, plan.micro_batch
        assert o.optimizer_states in ("fp32", "bf16"), o
        o.check(2, "fp32", shape.layers, accumulation=plan.accumulation, heads=shape.heads)
        assert plan.estimate.fits
        assert plan.estimate.disk_bytes > 0
        less = replace(o, nvme_offload_fraction=round(o.nvme_offload_fraction - 0.05, 2))
        assert not estimate(shape, less, 2, micro, 64, "fp32", device).fits, o
        for states in OPTIMIZER_STATES:  # nothing in memory fits, however narrow
            memory = replace(o, nvme_offload_fraction=0.0, optimizer_states=states)
            assert not estimate(shape, memory, 2, micro, 64, "fp32", device).fits, memory
        config = parse_args(shlex.split(plan.flags()))
        assert config.plugin_options() == o, (plan.flags(), o)
        slow = estimate(shape, o, 2, micro, 64, "fp32", replace(device, disk_bandwidth=1e8))
        assert slow.step_seconds > plan.estimate.step_seconds
    assert all(p.estimate.disk_bytes == 0 for p in plans if p not in on_disk)


def test_a_gpu_host_too_small_is_a_plan_that_does_not_fit() -> None:
    """With a GPU's host memory known, a layout whose host share does not
    fit it is not a plan, however little device memory it needs."""
    from pc_train.hardware import GiB

    shape = model_shape(resolve_model("llama-7b", 2048))
    gpu = replace(gpu_device("H100", "bf16"), memory_bytes=8 * GiB)
    offload = PluginOptions(PluginKind.ZERO2, cpu_offload=True)
    roomy = estimate(shape, offload, 8, 1, 2048, "bf16", replace(gpu, host_memory_bytes=400 * GiB))
    small = estimate(shape, offload, 8, 1, 2048, "bf16", replace(gpu, host_memory_bytes=GiB))
    assert roomy.host_fits
    assert not small.host_fits
    assert not small.fits
    assert small.device_bytes == roomy.device_bytes


def test_the_disk_bandwidth_is_measured_once_per_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: the disk's bandwidth]: measured by writing and reading a
    scratch file in the directory, cached per filesystem; a cache that is
    not a mapping of numbers is measured again, never run."""
    from pc_train import hardware

    where = tmp_path
    cache = where / "cache" / "disk-bandwidth.json"
    measured = hardware.disk_bandwidth(where, cache=cache)
    assert measured > 0
    assert list(where.glob("tmp*")) == []  # the probe file is gone
    calls: list[Path] = []

    def fake(path: Path) -> float:
        calls.append(path)
        return 5e8

    monkeypatch.setattr(hardware, "_measure", fake)
    assert hardware.disk_bandwidth(where, cache=cache) == measured
    assert calls == []
    cache.write_text("__import__('os').system('false')")
    assert hardware.disk_bandwidth(where, cache=cache) == 5e8
    assert len(calls) == 1
    link = where / "link"
    link.symlink_to(where / "cache")
    with pytest.raises(ValueError, match="is not a directory"):
        hardware.disk_bandwidth(link, cache=cache)  # never written through
    assert len(calls) == 1


def test_pipeline_schedules_are_planned_estimated_and_written() -> None:
    """[Note: pipeline schedules in the estimate]: interleaved 1F1B halves
    the bubble for more activations in flight, zero bubble (zbv) cuts it to
    a third; the planner offers both (interleaved where 2 pp stages divide
    the blocks), and each plan's flags parse back to its options."""
    shape = model_shape(resolve_model("llama-7b", 4096))  # 32 blocks
    gpu = gpu_device("H100", "bf16")
    base = PluginOptions(PluginKind.HYBRID, pp=4, zero_stage=1, microbatches=8)
    runs = {
        style: estimate(shape, replace(base, pp_style=style), 8, 1, 4096, "bf16", gpu)
        for style in ("1f1b", "interleaved", "zbv")
    }
    assert runs["interleaved"].step_seconds < runs["1f1b"].step_seconds
    assert runs["zbv"].step_seconds < runs["interleaved"].step_seconds
    assert runs["interleaved"].activation_bytes > runs["1f1b"].activation_bytes
    assert runs["interleaved"].params_per_rank == runs["1f1b"].params_per_rank
    interleaved = replace(base, pp_style="interleaved")
    assert len(interleaved.stage_blocks(32)) == 8
    assert interleaved.rank_blocks(32) == [8, 8, 8, 8]
    plans = search(shape, Cluster(1, 8, gpu), 64, 4096, "bf16")
    styles = {p.options.pp_style for p in plans if p.options.pp > 1}
    assert styles == {"1f1b", "interleaved", "zbv"}, styles
    for plan in plans:
        if plan.options.pp_style != "1f1b":
            assert parse_args(shlex.split(plan.flags())).plugin_options() == plan.options
    with pytest.raises(ValueError, match="--pp-style zbv is a schedule of --plugin hybrid"):
        PluginOptions(PluginKind.ZERO2, pp_style="zbv").check_flags()


def test_a_slightly_faster_or_slower_peak_does_not_tip_the_first_plan() -> None:
    """The first plan is the first searched of those within NEAR of the
    fastest: a small model on 2 CPU ranks, where DDP and a zero-bubble
    pipeline are predicted within 1 % of each other, gets DDP whatever the
    measured peak (before, a faster measurement chose the pipeline, and
    two starts of one command line trained different layouts)."""
    from pc_train.hardware import DeviceInfo

    shape = model_shape(resolve_model("gpt2-small", 64))
    firsts = set()
    for peak in (5e10, 1e11, 1.6e11, 3e11):
        device = DeviceInfo("cpu", 11 * 2**30, peak, 2e9, 0.5)
        plans = search(shape, Cluster(1, 2, device, device.bandwidth / 4), 16, 64, "fp32")
        one_step = rank([p for p in plans if p.accumulation == 1])
        firsts.add(one_step[0].options.describe())
        assert one_step[0].tokens_per_second >= (1 - NEAR) * one_step[1].tokens_per_second
    assert firsts == {"ddp"}, firsts
