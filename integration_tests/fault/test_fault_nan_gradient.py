"""Issue 44, nothing trained on garbage: a NaN gradient with a finite loss.

Through the Booster, for every plugin that clips by the global norm
(expert parallelism's two optimizers stepped together included), in
fp32 and bf16: one rank's gradients are NaN while its loss is finite;
the step raises :class:`pc_booster.NonFiniteGradientError` on every rank
with the weights unchanged (clipping by a NaN norm would have written NaN
over them), and the optimizer steps normally afterwards.

Through pc-train (``PC_TRAIN_FAULT=...,action=nan-grad``), ZeRO-2 and DDP
in fp32 and bf16: the run stops before that step's update, naming it,
and nothing is saved after the last good checkpoint."""

from __future__ import annotations

import math
import os
from pathlib import Path

import fault_runs
import pytest
import torch
import torch.distributed as dist

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    NonFiniteGradientError,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests
from pc_train.faults import nan_gradient
from pc_train.models import build_model, resolve_model
from pc_train.train import NonFiniteLossError

pytestmark = pytest.mark.timeout(600)

PLUGINS = ("ddp", "torch_ddp", "zero1", "zero2", "gemini", "fsdp", "hybrid_tp2", "hybrid_ep2")


def _plugin(name: str) -> Plugin:
    if name == "ddp":
        return DDPPlugin(max_norm=1.0)
    if name == "torch_ddp":
        return TorchDDPPlugin(max_norm=1.0)
    if name.startswith("zero"):
        return LowLevelZeroPlugin(stage=int(name[-1]), max_norm=1.0)
    if name == "gemini":
        return GeminiPlugin(max_norm=1.0)
    if name == "fsdp":
        return TorchFSDPPlugin(max_norm=1.0)
    if name == "hybrid_ep2":  # experts and dense parts stepped together
        return HybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=1, max_norm=1.0)
    return HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=0, max_norm=1.0)


def _nan_case(plugin: str, precision: str) -> None:
    made = _plugin(plugin)
    booster = Booster(plugin=made, mixed_precision=None if precision == "fp32" else precision)
    model = "mixtral-tiny" if plugin == "hybrid_ep2" else "gpt2-tiny"
    net = build_model(resolve_model(model, 16), seed=0)
    net, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def backward(poison: bool) -> torch.Tensor:
        loss: torch.Tensor = net(input_ids=ids, labels=ids).loss
        if poison and dist.get_rank() == 1:
            loss = nan_gradient(loss)
        booster.backward(loss, optimizer)
        return loss.detach()

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in made.model_state_dict(net).items()}

    backward(False)
    optimizer.step()
    optimizer.zero_grad()
    before = weights()
    loss = backward(True)
    assert math.isfinite(float(loss)), "the loss stays finite"
    with pytest.raises(NonFiniteGradientError, match=r"global norm is nan"):
        optimizer.step()
    optimizer.zero_grad()
    after = weights()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{plugin} {precision}: {key} changed"
    backward(False)  # and the optimizer steps on
    optimizer.step()
    optimizer.zero_grad()
    moved = weights()
    assert any(not torch.equal(moved[k], v) for k, v in before.items()), plugin
    for key, value in moved.items():
        assert bool(torch.isfinite(value.float()).all()), f"{plugin} {precision}: {key}"


def test_a_nan_gradient_is_refused_by_every_plugin_that_clips() -> None:
    cases = {"plugin": list(PLUGINS), "precision": ["fp32", "bf16"]}
    run_subtests(_nan_case, 2, cases, timeout=540)


def _nan_run(out: str, plugin: str, precision: str, clip: float) -> None:
    settings = {**fault_runs.settings(5), "plugin": plugin, "precision": precision}
    settings["clip_norm"] = clip
    os.environ["PC_TRAIN_FAULT"] = "rank=1,step=3,phase=backward,action=nan-grad"
    try:
        with pytest.raises(NonFiniteLossError, match=r"step 3: the loss is finite but the"):
            fault_runs.train_with(settings, out)
    finally:
        del os.environ["PC_TRAIN_FAULT"]


@pytest.mark.parametrize(
    ("plugin", "precision", "clip"),
    [("zero2", "fp32", 1.0), ("ddp", "bf16", 1.0), ("zero2", "bf16", 0.0), ("ddp", "fp32", 0.0)],
)
def test_pc_train_stops_before_a_nan_step(
    plugin: str, precision: str, clip: float, tmp_path: Path
) -> None:
    """With and without clipping: --check-finite has every plugin compute
    the global norm (a clip no gradient reaches where --clip-norm is 0)."""
    run_subtests(_nan_run, 2, {}, args=(str(tmp_path), plugin, precision, clip), timeout=240)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-000002"], saved  # nothing after the poisoned step
