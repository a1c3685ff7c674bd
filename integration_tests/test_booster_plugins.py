"""Every Booster plugin trains tiny GPT-2, Llama and BERT with loss and
parameter parity against single-process AdamW on the global batch, at
world sizes 2 and 4 (fp32)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from booster_models import MODELS, batch, build

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(900)

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch-ddp": TorchDDPPlugin,
    "ddp": DDPPlugin,
    "zero1": lambda: LowLevelZeroPlugin(stage=1),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, max_norm=0.05),
    "torch-fsdp": TorchFSDPPlugin,
    "gemini": GeminiPlugin,
    "gemini-step-in-backward": lambda: GeminiPlugin(step_in_backward=True),
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1, max_norm=0.05),
    "hybrid-tp2-sp": lambda: HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True),
    "hybrid-pp2": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2),
    "hybrid-pp2-zero1": lambda: HybridParallelPlugin(pp_size=2, zero_stage=1, num_microbatches=2),
    "hybrid-tp2-pp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2),
}
# Tensor x pipeline ranks each setup needs (the world must be a multiple).
MODEL_RANKS = {"hybrid-tp2-pp2": 4}
CLIP = {"zero2": 0.05, "hybrid-tp2-zero1": 0.05}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # lr 1e-4: Adam divides by the gradient's running RMS, so for an entry
    # whose gradient is near zero, a last-bit difference from a different
    # reduction order becomes a step of up to lr; 1e-4 keeps that within
    # the fp32 tolerance over 5 steps.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01)


def _step(booster: Booster, model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> Any:
    """One step's forward and backward: through the pipeline when there is
    one. Returns the loss."""
    if isinstance(booster.plugin, HybridParallelPlugin) and booster.plugin.pp_size > 1:
        return booster.execute_pipeline(iter([batch]), model, None, optimizer)["loss"]
    loss = model(**batch).loss
    booster.backward(loss, optimizer)
    return loss


def check_plugin_matches_single_process(plugin: str, model_name: str) -> None:
    if dist.get_world_size() % MODEL_RANKS.get(plugin, 1):
        return
    booster = Booster(plugin=PLUGINS[plugin]())
    ref = build(model_name)
    copied = copy.deepcopy(ref)
    model, optimizer, *_ = booster.boost(copied, _adamw(copied))
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    ref_opt = _adamw(ref)
    for step in range(5):
        full = batch(model_name, step, size=2 * dp)
        mine = {k: v[2 * dp_rank : 2 * dp_rank + 2] for k, v in full.items()}
        loss = _step(booster, model, optimizer, mine)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = ref(**full).loss
        ref_loss.backward()
        if plugin in CLIP:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP[plugin])
            assert norm > CLIP[plugin]
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=group)
        _close(mean / dp, ref_loss.detach(), f"step {step} loss")
    state = booster.plugin.model_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(state[key], value, f"final {key}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_plugins_match_single_process(world_size: int) -> None:
    run_subtests(
        check_plugin_matches_single_process,
        world_size,
        {"plugin": list(PLUGINS), "model_name": list(MODELS)},
        timeout=840,
    )


def check_accumulation_dataloader_and_scheduler(plugin: str) -> None:
    """Two micro-batches per step, the first under ``booster.no_sync``,
    match one step on the whole batch; the LR scheduler passed to boost
    drives the (possibly rebuilt) optimizer and round-trips through
    save/load; the dataloader gives each data-parallel rank its share."""
    booster = Booster(plugin=PLUGINS[plugin]())
    ref = build("gpt2")
    copied = copy.deepcopy(ref)
    optimizer = _adamw(copied)
    if plugin == "gemini-step-in-backward":  # every backward is a step: refused
        model, optimizer, *_ = booster.boost(copied, optimizer)
        with pytest.raises(ValueError, match="cannot accumulate"):
            booster.no_sync(model, optimizer)
        with pytest.raises(ValueError, match=r"max_norm=1\.0 cannot clip"):
            GeminiPlugin(step_in_backward=True, max_norm=1.0)
        return
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, _, _, scheduler = booster.boost(copied, optimizer, lr_scheduler=scheduler)
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    ref_opt = _adamw(ref)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0 / (1 + step))
    for step in range(3):
        full = batch("gpt2", step, size=4 * dp)
        mine = {k: v[4 * dp_rank : 4 * dp_rank + 4] for k, v in full.items()}
        halves = [{k: v[:2] for k, v in mine.items()}, {k: v[2:] for k, v in mine.items()}]
        with booster.no_sync(model, optimizer):
            booster.backward(model(**halves[0]).loss / 2, optimizer)
        booster.backward(model(**halves[1]).loss / 2, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ref(**full).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    state = booster.plugin.model_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(state[key], value, f"accumulated {key}")

    path = f"/tmp/pc-booster-scheduler-{plugin}.pt"
    booster.save_lr_scheduler(scheduler, path)
    again = torch.optim.lr_scheduler.LambdaLR(_adamw(build("gpt2")), lambda step: 1.0)
    booster.load_lr_scheduler(again, path)
    assert again.last_epoch == scheduler.last_epoch == 3

    data = list(range(8 * dp))
    loader = booster.plugin.prepare_dataloader(data, batch_size=2)  # type: ignore[arg-type]
    seen = [int(x) for b in loader for x in b]
    assert len(seen) == 8
    everyone: list[list[int]] = [[] for _ in range(dp)]
    dist.all_gather_object(everyone, seen, group=group)
    assert sorted(x for part in everyone for x in part) == data


def test_accumulation_dataloader_and_scheduler() -> None:
    run_subtests(
        check_accumulation_dataloader_and_scheduler,
        4,
        {"plugin": [p for p in PLUGINS if p not in CLIP and "pp" not in p]},
        timeout=600,
    )
