"""LowLevelZeroOptimizer's state with separate fp32 masters (bf16/fp16):
loading a state dict restores the masters and the loss scale exactly, and
a state without masters makes them follow the loaded model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests
from pc_zero import (
    LossScaleConfig,
    LowLevelZeroOptimizer,
    ShardedOptimizer,
    merge_sharded_state_dicts,
)

pytestmark = pytest.mark.timeout(300)


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    return model.to(dtype)


def _build(dtype: torch.dtype, stage: int) -> tuple[nn.Module, LowLevelZeroOptimizer]:
    model = _mlp(dtype)
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        stage=stage,
        reduce_bucket_size=40,
        loss_scale=LossScaleConfig(initial_scale=2.0**8),
    )
    return model, opt


def _train_step(model: nn.Module, opt: LowLevelZeroOptimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)
    mine = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    opt.backward((model(x[mine].to(opt.dtype)).float() - y[mine]).square().mean())
    opt.step()
    opt.zero_grad()


def _full_state(opt: LowLevelZeroOptimizer, source: str) -> dict[str, Any]:
    if source == "full":
        return opt.state_dict()
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, opt.sharded_state_dict())
    return merge_sharded_state_dicts(shards)


def check_load_restores_masters(dtype: torch.dtype, stage: int, source: str) -> None:
    model, opt = _build(dtype, stage)
    assert isinstance(opt, ShardedOptimizer)
    assert not opt.masters_are_params
    for step in range(2):
        _train_step(model, opt, step)
    if opt.scaler is not None:
        opt.scaler.scale = 2.0**7  # something other than the default to restore
    state = _full_state(opt, source)
    assert all("master" in entries for entries in state["state"].values())

    resumed, resumed_opt = _build(dtype, stage)
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(state)
    want, got = opt.full_params(), resumed_opt.full_params()
    assert want.keys() == got.keys()
    for index, value in want.items():
        torch.testing.assert_close(got[index], value, rtol=0, atol=0)
    assert resumed_opt.loss_scale == opt.loss_scale
    for step in range(2, 4):
        _train_step(model, opt, step)
        _train_step(resumed, resumed_opt, step)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # Without masters in the state, they follow the model's parameters.
    stripped = {
        **state,
        "state": {
            i: {k: v for k, v in entries.items() if k != "master"}
            for i, entries in state["state"].items()
        },
    }
    fresh, fresh_opt = _build(dtype, stage)
    fresh.load_state_dict(model.state_dict())
    fresh_opt.load_state_dict(stripped)
    for index, value in fresh_opt.full_params().items():
        torch.testing.assert_close(value, fresh_opt.params[index].detach().float())


def test_load_state_dict_restores_separate_masters() -> None:
    run_subtests(
        check_load_restores_masters,
        2,
        {"dtype": [torch.bfloat16, torch.float16], "stage": [1, 2], "source": ["full", "sharded"]},
    )
