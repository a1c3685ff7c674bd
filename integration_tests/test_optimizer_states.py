"""Adam's moments in bf16 and 8 bits through the Booster (``optimizer_states``
on LowLevelZeroPlugin and GeminiPlugin; pc_offload [Note: low-precision
optimizer states]): a tiny GPT-2 at world 2 matches one process keeping its
moments the same way (bf16), trains close to fp32 (int8), and its full and
sharded checkpoints resume exactly in the same format and load into the
others."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from booster_models import batch, build

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TrainPrecision
from pc_comm.testing import run_subtests
from pc_offload import CPUAdamW, HybridAdam

pytestmark = pytest.mark.timeout(600)

LR = 1e-2
PLUGINS: dict[str, Callable[[str], Plugin]] = {
    "zero2": lambda states: LowLevelZeroPlugin(stage=2, optimizer_states=states),
    "gemini": lambda states: GeminiPlugin(optimizer_states=states),
}


def _train(booster: Booster, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           steps: range) -> list[float]:  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        full = batch("gpt2", step, size=2 * world)
        loss = model(**{k: v[2 * rank : 2 * rank + 2] for k, v in full.items()}).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def _boost(plugin: str, states: str) -> tuple[Booster, torch.nn.Module, torch.optim.Optimizer]:
    booster = Booster(plugin=PLUGINS[plugin](states))
    model = build("gpt2")
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return booster, model, optimizer


def check_bf16_matches_one_process(plugin: str) -> None:
    booster, model, optimizer = _boost(plugin, "bf16")
    losses = _train(booster, model, optimizer, range(4))
    ref = build("gpt2")
    ref_opt = CPUAdamW(ref.parameters(), lr=LR, state_dtype="bf16")
    for step in range(4):
        loss = ref(**batch("gpt2", step, size=2 * dist.get_world_size())).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(losses[step] - float(loss)) <= 1e-5 * float(loss), (plugin, step)
    state = booster.plugin.model_state_dict(model)
    for key, value in ref.state_dict().items():
        # A moment on a bf16 rounding boundary may tip: about one bf16 level x lr.
        torch.testing.assert_close(state[key], value, rtol=0, atol=LR * 2**-5, msg=key)


def check_int8_trains_close_to_fp32(plugin: str) -> None:
    exact = _train(*_boost(plugin, "fp32"), range(8))
    narrow = _train(*_boost(plugin, "int8"), range(8))
    gap = max(abs(a - b) for a, b in zip(exact, narrow, strict=True))
    assert gap < 0.05, (plugin, exact, narrow)


def check_checkpoints_resume_and_cross_formats(plugin: str, saved: str, shard: bool) -> None:
    booster, model, optimizer = _boost(plugin, saved)
    _train(booster, model, optimizer, range(3))
    with tempfile.TemporaryDirectory() as folder:
        root = [folder]
        dist.broadcast_object_list(root)
        where = Path(root[0])
        booster.save_model(model, where / "model", shard=shard)
        booster.save_optimizer(optimizer, where / ("optim" if shard else "optim.pt"), shard=shard)
        went_on = _train(booster, model, optimizer, range(3, 6))
        for loaded in ("fp32", "bf16", "int8"):
            again, resumed_model, resumed_opt = _boost(plugin, loaded)
            again.load_model(resumed_model, where / "model")
            again.load_optimizer(resumed_opt, where / ("optim" if shard else "optim.pt"))
            losses = _train(again, resumed_model, resumed_opt, range(3, 6))
            label = (plugin, saved, loaded, shard, losses, went_on)
            if loaded == saved:
                assert losses == went_on, label
            else:
                assert max(abs(a - b) for a, b in zip(losses, went_on, strict=True)) < 0.05, label
        dist.barrier()


def _disk_plugin(plugin: str, fraction: float, scratch: str) -> Plugin:
    disk: dict[str, Any] = {"nvme_offload_fraction": fraction, "nvme_offload_dir": scratch}
    if plugin == "zero2":
        # Buckets of 4 k elements: several pieces to place (each goes whole).
        return LowLevelZeroPlugin(stage=2, cpu_offload=True, reduce_bucket_size_in_m=0.004, **disk)
    return GeminiPlugin(offload_param_frac=1.0, **disk)


def _on_tier(optimizer: Any) -> tuple[int, int]:
    """The bytes of this rank's states on the NVMe tier, and in all."""
    while not hasattr(optimizer, "nvme") and hasattr(optimizer, "inner"):
        optimizer = optimizer.inner
    tier = getattr(optimizer, "nvme", None)
    values = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    held = sum(v.nbytes for v in values if tier is not None and tier.holds(v))
    return held, sum(v.nbytes for v in values)


def check_states_on_disk_train_bitwise_as_in_memory(plugin: str) -> None:
    """fp32 states on the NVMe tier ([Note: the NVMe tier] in pc_offload.nvme)
    under ZeRO-2 with CPU offload and under Gemini, asked of the plugin
    (``nvme_offload_fraction``) or of pc-offload's Adam: 20 steps bitwise
    equal to the same run with them in memory, and the bytes on the tier
    those the plugin's memory model counts (``StateBytes.disk``)."""
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        # In memory first (pc-offload's Adam: the one a plugin converts torch's to).
        for fraction, asked_of in ((0.0, "adam"), (1.0, "adam"), (1.0, "plugin"), (0.5, "plugin")):
            model = build("gpt2")
            if asked_of == "plugin":
                booster = Booster(plugin=_disk_plugin(plugin, fraction, scratch))
                optimizer: Any = torch.optim.AdamW(model.parameters(), lr=LR)
            else:  # the tier built by the user, as with Colossal-AI's HybridAdam
                booster = Booster(plugin=_disk_plugin(plugin, 0.0, scratch))
                cls = CPUAdamW if plugin == "zero2" else HybridAdam
                disk: dict[str, Any] = {
                    "nvme_offload_fraction": fraction,
                    "nvme_offload_dir": scratch,
                }
                optimizer = cls(model.parameters(), lr=LR, weight_decay=1e-2, **disk)
            model, optimizer, *_ = booster.boost(model, optimizer)
            runs.append(_train(booster, model, optimizer, range(20)))
            held, total = _on_tier(optimizer)
            states = booster.plugin.options.model_states(
                sum(p.numel() for p in build("gpt2").parameters()), dist.get_world_size(),
                TrainPrecision.FP32,
            )  # fmt: skip
            if asked_of == "plugin":  # padding to chunks; at 0.5, whole pieces
                assert states.disk == pytest.approx(held, rel=0.1 if fraction != 0.5 else 0.25), (
                    plugin, fraction, held, states.disk,
                )  # fmt: skip
            if fraction == 1.0:
                assert held == total > 0, (plugin, asked_of, held, total)
            elif fraction:  # within a tensor of the fraction, by elements
                assert 0.2 < held / total < 0.8, (plugin, held, total)
            del booster, model, optimizer
    assert all(run == runs[0] for run in runs), (plugin, runs)


def test_optimizer_states_through_the_booster() -> None:
    run_subtests(check_bf16_matches_one_process, 2, {"plugin": list(PLUGINS)})
    run_subtests(check_int8_trains_close_to_fp32, 2, {"plugin": list(PLUGINS)})
    run_subtests(check_states_on_disk_train_bitwise_as_in_memory, 2, {"plugin": list(PLUGINS)})
    run_subtests(
        check_checkpoints_resume_and_cross_formats,
        2,
        {"plugin": list(PLUGINS), "saved": ["bf16", "int8"], "shard": [False, True]},
    )
