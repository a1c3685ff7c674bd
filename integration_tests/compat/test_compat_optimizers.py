"""A Colossal-AI training loop with only its imports changed: ``HybridAdam``
/ ``CPUAdam`` (pc_offload) under ``Booster(plugin=LowLevelZeroPlugin(stage=2))``
or ``TorchDDPPlugin``, driven by Colossal-AI's LR schedulers
(pc_compat.colossalai.nn.lr_scheduler), against one process training on the whole batch
with torch's AdamW / Adam and the schedule worked out here from its formula.

First, each scheduler's learning rate at every step against the formula it
documents (the values Colossal-AI's gives, read from their source), its
state dict, and its refusals."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from pc_booster import Booster, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from pc_comm.testing import run_subtests
from pc_compat.colossalai.nn.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
)
from pc_offload import CPUAdam, HybridAdam

BASE_LRS = (0.1, 0.03)  # two param groups, each scheduled from its own lr
STEPS = 14

# -- the schedules, written from their formulas -------------------------------------


def cosine(base: float, k: int, total: int, eta_min: float) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * k / total)) / 2


def cosine_warmup(base: float, k: int, total: int, warmup: int, eta_min: float) -> float:
    if k < warmup:
        return base * (k + 1) / warmup
    if total == warmup:
        return eta_min
    return cosine(base, k - warmup, total - warmup, eta_min)


def linear_warmup(base: float, k: int, total: int, warmup: int) -> float:
    if k < warmup:
        return base * (k + 1) / (warmup + 1)
    return base * max(total - k, 0) / (total - warmup) if total > warmup else 0.0


def polynomial(base: float, k: int, total: int, end: float, power: float) -> float:
    if total == 0:
        return end
    return (base - end) * float((1 - min(k, total) / total) ** power) + end


def polynomial_warmup(
    base: float, k: int, total: int, warmup: int, end: float, power: float
) -> float:
    if k < warmup:
        return base * (k + 1) / warmup
    return polynomial(base, k - warmup, total - warmup, end, power)


def one_cycle(base: float, k: int, total: int, pct: float, div: float, final_div: float,
              strategy: str, three_phase: bool) -> float:  # fmt: skip
    start_lr = base / div
    low = start_lr / final_div
    up = pct * total - 1
    if three_phase:
        phases = [
            (up, start_lr, base),
            (2 * pct * total - 2, base, start_lr),
            (total - 1, start_lr, low),
        ]
    else:
        phases = [(up, start_lr, base), (total - 1, base, low)]
    begin = 0.0
    for i, (end, a, b) in enumerate(phases):
        if k <= end or i == len(phases) - 1:
            frac = (k - begin) / (end - begin)
            if strategy == "cos":
                return b + (a - b) / 2 * (1 + math.cos(math.pi * frac))
            return a + (b - a) * frac
        begin = end
    raise AssertionError("unreachable")


Schedule = tuple[Callable[[torch.optim.Optimizer], LRScheduler], Callable[[float, int], float]]

SCHEDULES: dict[str, Schedule] = {
    "cosine": (
        lambda o: CosineAnnealingLR(o, 10, eta_min=0.001),
        lambda b, k: cosine(b, k, 10, 0.001),  # rises again past 10, as torch's
    ),
    "cosine-warmup": (
        lambda o: CosineAnnealingWarmupLR(o, 10, warmup_steps=3, eta_min=0.001),
        lambda b, k: cosine_warmup(b, k, 10, 3, 0.001),
    ),
    "cosine-warmup-0": (
        lambda o: CosineAnnealingWarmupLR(o, 12),
        lambda b, k: cosine_warmup(b, k, 12, 0, 0.0),
    ),
    "cosine-all-warmup": (
        lambda o: CosineAnnealingWarmupLR(o, 4, warmup_steps=4, eta_min=0.002),
        lambda b, k: cosine_warmup(b, k, 4, 4, 0.002),
    ),
    "linear-warmup": (
        lambda o: LinearWarmupLR(o, 10, warmup_steps=3),
        lambda b, k: linear_warmup(b, k, 10, 3),  # 0 past 10, not negative
    ),
    "linear-all-warmup": (
        lambda o: LinearWarmupLR(o, 5, 5),
        lambda b, k: linear_warmup(b, k, 5, 5),
    ),
    "poly": (
        lambda o: PolynomialLR(o, 10, end_lr=0.001, power=2.0),
        lambda b, k: polynomial(b, k, 10, 0.001, 2.0),
    ),
    "poly-warmup": (
        lambda o: PolynomialWarmupLR(o, 10, warmup_steps=2, end_lr=0.002, power=0.5),
        lambda b, k: polynomial_warmup(b, k, 10, 2, 0.002, 0.5),
    ),
    "multistep": (
        lambda o: MultiStepLR(o, 10, milestones=[3, 7], gamma=0.5),
        lambda b, k: b * 0.5 ** sum(k >= m for m in (3, 7)),
    ),
    "multistep-none": (lambda o: MultiStepLR(o, 10), lambda b, k: b),
    "one-cycle": (
        lambda o: OneCycleLR(o, 20, pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
        lambda b, k: one_cycle(b, k, 20, 0.25, 10.0, 100.0, "cos", False),
    ),
    "one-cycle-linear-3": (
        lambda o: OneCycleLR(o, 20, 0.25, "linear", three_phase=True),
        lambda b, k: one_cycle(b, k, 20, 0.25, 25.0, 1e4, "linear", True),
    ),
}


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.AdamW(
        [{"params": [a], "lr": BASE_LRS[0]}, {"params": [b], "lr": BASE_LRS[1]}]
    )


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_follows_its_formula(name: str) -> None:
    make, formula = SCHEDULES[name]
    optimizer = _optimizer()
    scheduler = make(optimizer)
    assert isinstance(scheduler, LRScheduler)
    steps = 20 if name.startswith("one-cycle") else STEPS
    for k in range(steps):
        expected = [formula(base, k) for base in BASE_LRS]
        assert _lrs(optimizer) == pytest.approx(expected, rel=1e-12, abs=1e-15), f"step {k}"
        assert scheduler.get_last_lr() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_state_dict_resumes_the_schedule(name: str) -> None:
    make, formula = SCHEDULES[name]
    first = _optimizer()
    scheduler = make(first)
    for _ in range(5):
        first.step()
        scheduler.step()
    saved = copy.deepcopy((first.state_dict(), scheduler.state_dict()))
    second = _optimizer()
    resumed = make(second)
    second.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    assert resumed.last_epoch == 5
    for k in range(5, 9):
        second.step()
        resumed.step()
        expected = [formula(base, k + 1) for base in BASE_LRS]
        assert _lrs(second) == pytest.approx(expected, rel=1e-12, abs=1e-15), f"step {k + 1}"


def test_one_cycle_cycles_beta1_between_its_momenta() -> None:
    optimizer = _optimizer()
    scheduler = OneCycleLR(optimizer, 20, pct_start=0.25, base_momentum=0.8, max_momentum=0.9)
    assert [g["betas"][0] for g in optimizer.param_groups] == [0.9, 0.9]
    for _ in range(4):  # the peak: pct_start * total_steps - 1
        optimizer.step()
        scheduler.step()
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.8, 0.8])
    fixed = _optimizer()
    OneCycleLR(fixed, 20, cycle_momentum=False)
    assert [g["betas"][0] for g in fixed.param_groups] == [0.9, 0.9]


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match=r"expected total_steps > 0, got 0"):
        CosineAnnealingLR(_optimizer(), 0)
    with pytest.raises(
        ValueError, match=r"0 <= warmup_steps <= total_steps \(10\), got warmup_steps=11"
    ):
        CosineAnnealingWarmupLR(_optimizer(), 10, warmup_steps=11)
    with pytest.raises(ValueError, match=r"warmup_steps=-1"):
        LinearWarmupLR(_optimizer(), 10, warmup_steps=-1)
    with pytest.raises(ValueError, match=r"expected end_lr >= 0, got -0.1"):
        PolynomialWarmupLR(_optimizer(), 10, end_lr=-0.1)


# -- the Colossal-AI loop, two ranks against one process ----------------------------

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-ddp": TorchDDPPlugin,
}
PEAK_LR, WEIGHT_DECAY, TRAIN_STEPS, TOTAL, WARMUP = 2e-3, 0.1, 6, 8, 2

# name: (pc's optimizer as a Colossal-AI program builds it, torch's reference)
Make = Callable[..., torch.optim.Optimizer]
OPTIMIZERS: dict[str, tuple[Make, Make]] = {
    "HybridAdam": (lambda groups: HybridAdam(groups, lr=PEAK_LR, weight_decay=WEIGHT_DECAY),
                   torch.optim.AdamW),
    "CPUAdam-l2": (lambda groups: CPUAdam(groups, lr=PEAK_LR, weight_decay=WEIGHT_DECAY,
                                          adamw_mode=False),
                   torch.optim.Adam),
}  # fmt: skip
SCHEDULERS: dict[str, tuple[Callable[[Any], LRScheduler], Callable[[int], float]]] = {
    "cosine-warmup": (
        lambda o: CosineAnnealingWarmupLR(o, total_steps=TOTAL, warmup_steps=WARMUP, eta_min=1e-5),
        lambda k: cosine_warmup(PEAK_LR, k, TOTAL, WARMUP, 1e-5),
    ),
    "linear-warmup": (
        lambda o: LinearWarmupLR(o, total_steps=TOTAL, warmup_steps=WARMUP),
        lambda k: linear_warmup(PEAK_LR, k, TOTAL, WARMUP),
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    # As Colossal-AI's examples do: no weight decay on biases.
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check_colossal_loop(plugin: str, optimizer_name: str, schedule: str) -> None:
    make_optimizer, reference_cls = OPTIMIZERS[optimizer_name]
    make_scheduler, lr_at = SCHEDULERS[schedule]
    rank, world = dist.get_rank(), dist.get_world_size()

    # The program: Colossal-AI's calls, pc's imports.
    model = _model()
    optimizer = make_optimizer(_groups(model))
    lr_scheduler = make_scheduler(optimizer)
    booster = Booster(plugin=PLUGINS[plugin]())
    model, optimizer, _, _, lr_scheduler = booster.boost(
        model, optimizer, lr_scheduler=lr_scheduler
    )

    # The reference: one process, the whole batch, lr set by hand.
    ref = _model()
    ref_opt = reference_cls(_groups(ref), lr=PEAK_LR, weight_decay=WEIGHT_DECAY)
    share = 8 // world
    for step in range(TRAIN_STEPS):
        x, y = _batch(step)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(step), rel=1e-12)
        mine = slice(rank * share, (rank + 1) * share)
        loss = (model(x[mine]) - y[mine]).square().mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()

        for group in ref_opt.param_groups:
            group["lr"] = lr_at(step)
        ref_loss = (ref(x) - y).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        mean = loss.detach().clone()
        dist.all_reduce(mean)
        _close(mean / world, ref_loss.detach(), f"step {step} loss")
        state = booster.plugin.model_state_dict(model)
        for key, value in ref.state_dict().items():
            _close(state[key], value, f"step {step} {key}")


@pytest.mark.timeout(120)
def test_colossal_loop_matches_single_process() -> None:
    run_subtests(
        check_colossal_loop,
        2,
        {"plugin": list(PLUGINS), "optimizer_name": list(OPTIMIZERS), "schedule": list(SCHEDULERS)},
        timeout=100,
    )
