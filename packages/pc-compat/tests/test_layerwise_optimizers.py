"""Colossal-AI's ``Lamb`` and ``Lars`` at the edge: their arithmetic
checked against torch's optimizers where they reduce to one (Lamb with
``adam=True``, ``bias_correction=True`` and ``eps=0`` is Adam; Lars with
``lars=False`` in a group is SGD with momentum) and against the trust
ratio's defining property (each whole parameter moves by ``lr * |p|``,
Lamb, or ``lr * eeta * |p|``, Lars); at world 2 they train under
TorchDDPPlugin and HybridParallelPlugin(zero_stage=0) to single-process
training's losses and parameters (3 steps, rtol 1e-5, atol 1e-6), and the
plugins that step shards refuse them at boost with the reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from pc_compat.colossalai.nn.optimizer import Lamb, Lars

pytestmark = pytest.mark.timeout(90)

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_lamb_as_adam_is_torchs_adam() -> None:
    ours, theirs = _model(), _model()
    lamb = Lamb(ours.parameters(), lr=1e-2, eps=0.0, adam=True, bias_correction=True)
    adam = torch.optim.Adam(theirs.parameters(), lr=1e-2, eps=0.0)
    assert _train(ours, lamb) == pytest.approx(_train(theirs, adam), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lamb_moves_each_parameter_by_lr_times_its_norm() -> None:
    for kwargs in ({}, {"weight_decay": 0.1}, {"bias_correction": True}):
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        _train(model, Lamb(model.parameters(), lr=1e-2, **kwargs), steps=1)
        for old, new in zip(before, model.parameters(), strict=True):
            scale = 1.0 if not kwargs.get("bias_correction") else (1 - 0.999) ** 0.5 / (1 - 0.9)
            want = 1e-2 * scale * old.norm()
            torch.testing.assert_close((new - old).norm(), want, rtol=1e-4, atol=0)


def test_lars_without_the_ratio_is_torchs_sgd_with_momentum() -> None:
    ours, theirs = _model(), _model()
    lars = Lars([{"params": list(ours.parameters()), "lars": False}], lr=0.1, momentum=0.9)
    sgd = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    assert _train(ours, lars) == pytest.approx(_train(theirs, sgd), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lars_moves_each_parameter_by_lr_eeta_times_its_norm() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, Lars(model.parameters(), lr=0.5, eeta=1e-2), steps=1)
    for old, new in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close((new - old).norm(), 0.5 * 1e-2 * old.norm(), rtol=1e-4, atol=0)


def test_arguments_are_checked_as_colossalai_checks_them() -> None:
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="Invalid learning rate: 1"):
        Lars(params, lr=1)  # Colossal-AI's Lars takes a float rate only
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        Lamb(params, betas=(0.9, 1.0))


# -- at world 2, through the booster ----------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "lamb": lambda p: Lamb(p, lr=1e-2, weight_decay=0.01, bias_correction=True),
    "lars": lambda p: Lars(p, lr=0.5, momentum=0.9, eeta=1e-2, weight_decay=1e-4),
}
TRAINS: dict[str, Callable[[], Any]] = {
    "torch_ddp": lambda: TorchDDPPlugin(),
    "hybrid_zero0": lambda: HybridParallelPlugin(1, 1, zero_stage=0, precision="fp32"),
}
REFUSES: dict[str, Callable[[], Any]] = {
    "low_level_zero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "gemini": lambda: GeminiPlugin(precision="fp32"),
    "hybrid_zero1": lambda: HybridParallelPlugin(1, 1, zero_stage=1, precision="fp32"),
}


def check_case(optimizer: str, plugin: str) -> None:
    make = OPTIMIZERS[optimizer]
    if plugin in REFUSES:
        model = _model()
        booster = Booster(plugin=REFUSES[plugin]())
        with pytest.raises(ValueError, match=r"trust ratio.*steps shards of the parameters"):
            booster.boost(model, make(model.parameters()))
        return
    reference = _model()
    want = _train(reference, make(reference.parameters()))
    model = _model()
    booster = Booster(plugin=TRAINS[plugin]())
    boosted, opt, *_ = booster.boost(model, make(model.parameters()))
    half = slice(dist.get_rank() * BATCH // 2, (dist.get_rank() + 1) * BATCH // 2)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(boosted(x[half]), y[half])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / dist.get_world_size())
    assert losses == pytest.approx(want, rel=RTOL, abs=ATOL)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)


def test_layerwise_optimizers_train_under_whole_tensor_plugins_only() -> None:
    cases = {"optimizer": list(OPTIMIZERS), "plugin": [*TRAINS, *REFUSES]}
    run_subtests(check_case, 2, cases, timeout=80)
