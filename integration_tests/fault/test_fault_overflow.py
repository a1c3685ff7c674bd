"""An inf in one rank's fp16 gradients, through the Booster: for ZeRO-1,
ZeRO-2 and Gemini, every rank skips the step (parameters unchanged on all
ranks), the loss scale halves (hysteresis 1: at the first overflow), and
the next step trains."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin
from pc_comm.testing import run_subtests
from pc_train.models import build_model, resolve_model

pytestmark = pytest.mark.timeout(300)


def _plugin(name: str) -> Plugin:
    if name == "gemini":
        return GeminiPlugin(initial_scale=2.0**10, hysteresis=1)
    return LowLevelZeroPlugin(stage=int(name[-1]), initial_scale=2.0**10, hysteresis=1)


def _overflow_case(plugin: str) -> None:
    booster = Booster(plugin=_plugin(plugin), mixed_precision="fp16")
    net = build_model(resolve_model("gpt2-tiny", 16), seed=0)
    net, optimizer, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(poison: bool) -> None:
        loss = net(input_ids=ids, labels=ids).loss
        if poison and dist.get_rank() == 1:  # one rank's gradients overflow
            loss = loss * torch.tensor(float("inf"), dtype=loss.dtype)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    step(False)
    before = {k: v.clone() for k, v in booster.plugin.model_state_dict(net).items()}
    scale = optimizer.loss_scale
    step(True)
    after = booster.plugin.model_state_dict(net)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{plugin}: {key} changed on a skipped step"
    assert optimizer.loss_scale == scale / 2, (plugin, optimizer.loss_scale, scale)
    step(False)  # and training goes on
    moved = booster.plugin.model_state_dict(net)
    assert any(not torch.equal(moved[k], v) for k, v in before.items()), plugin


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    run_subtests(_overflow_case, 2, {"plugin": ["zero1", "zero2", "gemini"]}, timeout=240)
