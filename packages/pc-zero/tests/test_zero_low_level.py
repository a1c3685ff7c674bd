"""LowLevelZeroOptimizer (ZeRO-1/2) against single-process training on the
global batch: parameters equal at fp32 tolerance after every one of 10
steps, across optimizer x stage x offload x accumulation x param groups x
clipping.

Adam is blind to a constant factor on the gradients (a sum instead of an
average would pass), so every case also runs with SGD + momentum, which is
not."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests
from pc_zero import LowLevelZeroOptimizer

pytestmark = pytest.mark.timeout(600)

STEPS, GLOBAL_BATCH = 10, 8


class OddMLP(nn.Module):
    """Odd sizes, so buckets and pieces need padding."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.mid = nn.Linear(13, 11)
        self.out = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        return out


def _groups(model: nn.Module, two: bool) -> list[dict[str, object]]:
    if not two:
        return [{"params": list(model.parameters())}]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": 0.1},
        {"params": biases, "lr": 3e-2, "weight_decay": 0.0},
    ]


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = (model(x) - y).square().mean()
    return out


def _optimizer(name: str, groups: list[dict[str, object]]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if name == "adam":  # L2 weight decay: offloaded, it must stay L2 (not pc_offload's AdamW)
        return torch.optim.Adam(groups, lr=1e-2)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def check_parity(
    optim: str, stage: int, offload: bool, accum: int, two_groups: bool, clip: float
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = OddMLP()
    ref = copy.deepcopy(model)
    ref_opt = _optimizer(optim, _groups(ref, two_groups))
    opt = LowLevelZeroOptimizer(
        _optimizer(optim, _groups(model, two_groups)),
        stage=stage,
        cpu_offload=offload,
        max_norm=clip,
        reduce_bucket_size=40,  # several buckets, some holding one parameter
    )
    clipped = 0
    for step in range(STEPS):
        for micro in range(accum):
            x, y = _batch(step, micro)
            (_loss(ref, x, y) / accum).backward()  # type: ignore[no-untyped-call]
            mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
            loss = _loss(model, x[mine], y[mine]) / accum
            if stage == 1 and micro < accum - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            clipped += int(norm > clip)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    if clip:
        assert clipped >= STEPS // 2, f"clipping engaged on only {clipped} steps"
    # The optimizer steps only this rank's share: one piece per bucket.
    numel = sum(p.numel() for p in model.parameters())
    owned = sum(m.numel() for m in opt._masters)
    assert owned <= math.ceil(numel / world) + len(opt.buckets), (owned, numel)


CASES: dict[str, list[Any]] = {
    "optim": ["adamw", "sgd"],
    "stage": [1, 2],
    "offload": [False, True],
    "accum": [1, 2],
    "two_groups": [False, True],
    "clip": [0.0, 0.05],
}


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_single_process_adamw(world: int) -> None:
    run_subtests(check_parity, world, CASES, timeout=500)


def test_parity_with_torch_adam_offloaded() -> None:
    cases = {**{k: v[:1] for k, v in CASES.items()}, "optim": ["adam"], "offload": [True]}
    cases["two_groups"] = [True]  # weight decay 0.1 on the weights
    cases["stage"] = [1, 2]
    run_subtests(check_parity, 2, cases, timeout=200)
