"""The ZeRO optimizers' clip settings ([Note: clipping inside the step] in
pc_zero.clipping): ``max_norm`` in both, ``clip_next_step`` against
single-process training that clips only the steps it was asked for."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import one_process_group, spawn
from pc_zero import GeminiDDP, GeminiOptimizer, LowLevelZeroOptimizer, ShardedModule

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH, LR = 8, 1e-2
# Per step: the norms passed to clip_next_step before it (the last one
# counts), with max_norm 0 and with max_norm MAX.
PLAN: list[tuple[float, ...]] = [(0.05,), (), (0.5, 0.02), ()]
MAX = 0.1


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = (model(x) - y).square().mean()
    return out


def _expected_norm(asked: tuple[float, ...], max_norm: float) -> float:
    if not asked:
        return max_norm
    return min(asked[-1], max_norm) if max_norm > 0 else asked[-1]


def _train(
    reference: nn.Module,
    model: nn.Module,
    opt: LowLevelZeroOptimizer | GeminiOptimizer,
    full_params: Callable[[], list[torch.Tensor]],
) -> None:
    """PLAN's steps on both, the global batch split over the ranks; every
    parameter compared after each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    configured = opt.max_norm
    for step, asked in enumerate(PLAN):
        x, y = _batch(step)
        _loss(reference, x, y).backward()  # type: ignore[no-untyped-call]
        clip = _expected_norm(asked, configured)
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert norm > clip  # the clipping is exercised
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        opt.backward(_loss(model, x[mine], y[mine]))
        for max_norm in asked:
            opt.clip_next_step(max_norm)
        opt.step()
        opt.zero_grad()
        assert opt.max_norm == configured  # a one-step norm is spent
        for p, q in zip(reference.parameters(), full_params(), strict=True):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")


def check_low_level(stage: int, max_norm: float) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        stage=stage,
        max_norm=max_norm,
        reduce_bucket_size=40,
    )
    _train(reference, model, opt, lambda: [p.detach() for p in model.parameters()])


def check_gemini(max_norm: float) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    wrapped = GeminiDDP(model, chunk_size=64)
    opt = GeminiOptimizer(
        torch.optim.AdamW(wrapped.parameters(), lr=LR), wrapped, max_norm=max_norm
    )

    def full_params() -> list[torch.Tensor]:
        with wrapped.summon_full_params():
            return [p.detach().clone() for p in model.parameters()]

    _train(reference, model, opt, full_params)


def check_clip_next_step() -> None:
    for max_norm in (0.0, MAX):
        for stage in (1, 2):
            check_low_level(stage, max_norm)
        check_gemini(max_norm)


def test_clip_next_step_clips_that_step_only() -> None:
    spawn(check_clip_next_step, 2, timeout=240)


@pytest.fixture
def _group() -> Iterator[None]:
    with one_process_group():
        yield


@pytest.mark.usefixtures("_group")
def test_max_norm_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        LowLevelZeroOptimizer(torch.optim.AdamW(_mlp().parameters()), max_norm=-1.0)


@pytest.mark.usefixtures("_group")
def test_clip_next_step_refuses_what_cannot_clip() -> None:
    opt = LowLevelZeroOptimizer(torch.optim.AdamW(_mlp().parameters()))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="must be > 0"):
            opt.clip_next_step(bad)
    wrapped: ShardedModule = GeminiDDP(_mlp(), step_in_backward=True)
    gemini = GeminiOptimizer(torch.optim.AdamW(wrapped.parameters()), wrapped)
    with pytest.raises(ValueError, match="nothing left to clip"):
        gemini.clip_next_step(1.0)
