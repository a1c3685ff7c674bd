"""Two-level sharding (issue 43): LowLevelZeroPlugin(extra_dp_size=2) and
GeminiPlugin(extra_dp_size=2) at world 4 shard the model over each pair of
consecutive ranks and average the reduced gradient pieces (chunk shards)
across the pairs ([Note: two-level sharding] in pc_zero, [Note: shards] in
pc_chunk.chunk). Against single-process training of the same model on the same
global batch (each rank a quarter): losses and every parameter at rtol
1e-5 / atol 1e-6 over 4 steps (AdamW: atol 1e-5), ZeRO-1, ZeRO-2 and
Gemini, SGD and AdamW, with clipping by the global norm. A sharded checkpoint saved
under two-level sharding continues at rtol 1e-5 under full sharding
(extra_dp_size=1) and back. One spawn runs every case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH, WIDTH = 4, 8, 16
CLIP = 0.05  # below the gradient norm here: the clip acts at every step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 4, generator=g)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _reference(kind: str, clip: float) -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = _optimizer(kind, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if clip:
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"the clip at {clip} is not exercised (norm {norm})"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _plugin(stage: int, extra: int, clip: float) -> Plugin:
    """ZeRO-``stage`` (1, 2), or Gemini for stage 3."""
    if stage == 3:
        return GeminiPlugin(extra_dp_size=extra, max_norm=clip, chunk_size=256)
    return LowLevelZeroPlugin(stage=stage, extra_dp_size=extra, max_norm=clip)


def _boosted(stage: int, extra: int, kind: str, clip: float) -> tuple[Booster, Any, Any]:
    booster = Booster(plugin=_plugin(stage, extra, clip))
    model = _model()
    model, opt, *_ = booster.boost(model, _optimizer(kind, model.parameters()))
    return booster, model, opt


def _train(booster: Booster, model: Any, opt: Any, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = (t.chunk(world)[rank] for t in _batch(step))
        loss = nn.functional.mse_loss(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    return losses


def check_parity(stage: int, kind: str, clip: float) -> None:
    rtol, atol = (1e-5, 1e-6) if kind == "sgd" else (1e-5, 1e-5)
    reference, want = _reference(kind, clip)
    booster, model, opt = _boosted(stage, 2, kind, clip)
    got = _train(booster, model, opt, range(STEPS))
    assert got == pytest.approx(want, rel=rtol, abs=atol), (got, want)
    state = booster.plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol)


def check_checkpoint(stage: int, root: str) -> None:
    path = Path(root) / f"zero{stage}"
    for saved, loaded in ((2, 1), (1, 2)):
        where = path / f"{saved}-{loaded}"
        booster, model, opt = _boosted(stage, saved, "adamw", 0.0)
        _train(booster, model, opt, range(2))
        booster.save_model(model, where / "model", shard=True)
        booster.save_optimizer(opt, where / "optim", shard=True)
        want = _train(booster, model, opt, range(2, STEPS))
        booster, model, opt = _boosted(stage, loaded, "adamw", 0.0)
        booster.load_model(model, where / "model")
        booster.load_optimizer(opt, where / "optim")
        got = _train(booster, model, opt, range(2, STEPS))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (saved, loaded, got, want)


def check_case(root: str, case: str) -> None:
    kind, stage, *rest = case.split("-")
    if kind == "checkpoint":
        check_checkpoint(int(stage), root)
    else:
        check_parity(int(stage), kind, CLIP if "clip" in rest else 0.0)


# <optimizer>-<stage>[-clip]: stage 3 is Gemini; checkpoint-<stage>.
CASES = [
    "sgd-1", "sgd-2", "adamw-1", "adamw-2-clip", "sgd-2-clip", "checkpoint-1", "checkpoint-2",
    "sgd-3", "adamw-3-clip", "sgd-3-clip", "checkpoint-3",
]  # fmt: skip


def test_two_level_sharding_matches_single_process(tmp_path: Path) -> None:
    run_subtests(check_case, 4, {"case": CASES}, args=(str(tmp_path),), timeout=280)


@pytest.mark.parametrize("plugin", ["low_level_zero", "gemini"])
def test_extra_dp_size_must_divide_the_ranks(plugin: str) -> None:
    from pc_booster.plugins.gemini import GeminiOptions
    from pc_booster.plugins.low_level_zero import LowLevelZeroOptions
    from pc_booster.rules import RunSetting

    options = (LowLevelZeroOptions if plugin == "low_level_zero" else GeminiOptions)(
        extra_dp_size=3
    )
    with pytest.raises(ValueError, match="extra_dp_size=3 must divide the 4 ranks"):
        options.validate(RunSetting(world=4))
