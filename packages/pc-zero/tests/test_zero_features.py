"""LowLevelZeroOptimizer beyond parity: fp16 overflow, the memory
accounting against the ZeRO paper, checkpoints across world sizes, and
errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests, spawn, tiny_gpt2
from pc_zero import (
    LossScaleConfig,
    LowLevelZeroOptimizer,
    merge_sharded_state_dicts,
    zero_paper_bytes,
)

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 8


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _local(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    return t.chunk(world)[rank]


def _train_step(model: nn.Module, opt: LowLevelZeroOptimizer, step: int) -> float:
    """One step on this rank's share of the global batch; the global loss."""
    x, y = _batch(step)
    loss = (model(_local(x).to(opt.dtype)).float() - _local(y)).square().mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


# -- fp16 overflow ----------------------------------------------------------------


def check_overflow(stage: int) -> None:
    rank = dist.get_rank()
    model = _mlp().half()
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        stage=stage,
        loss_scale=LossScaleConfig(initial_scale=2.0**10, hysteresis=1),
        reduce_bucket_size=64,
    )
    _train_step(model, opt, 0)  # a clean step: state exists, scale unchanged
    assert opt.loss_scale == 2.0**10
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.inner.state_dict()["state"])
    masters = [m.detach().clone() for m in opt._masters]

    # Only rank 0's gradient of one weight turns infinite.
    weight = model[2].get_parameter("weight")
    hook = weight.register_hook(  # type: ignore[no-untyped-call]
        lambda g: g * float("inf") if rank == 0 else g
    )
    _train_step(model, opt, 1)
    hook.remove()
    assert opt.loss_scale == 2.0**9, opt.loss_scale
    for before, p in zip(params, model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    for before, m in zip(masters, opt._masters, strict=True):
        torch.testing.assert_close(m, before, rtol=0, atol=0)
    after = opt.inner.state_dict()["state"]
    assert after.keys() == state.keys()
    for k in state:
        for key, value in state[k].items():
            torch.testing.assert_close(after[k][key], value, rtol=0, atol=0)

    _train_step(model, opt, 2)  # and training goes on
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), params, strict=True))
    assert opt.loss_scale == 2.0**9


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    run_subtests(check_overflow, 2, {"stage": [1, 2]})


# -- memory accounting ------------------------------------------------------------


def check_accounting(stage: int, dtype: torch.dtype) -> None:
    world = dist.get_world_size()
    model = tiny_gpt2(n_embd=64, n_layer=2).to(dtype)
    psi = sum(p.numel() for p in model.parameters())
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, reduce_bucket_size=4096
    )
    ids = torch.randint(0, 97, (2, 16))
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    got = opt.memory()
    mixed = dtype != torch.float32
    expected = zero_paper_bytes(stage, psi, world, mixed=mixed)
    assert abs(got.total - expected) <= 0.05 * expected, (stage, dtype, got, expected)
    # And by kind, as the formula splits it.
    width = 2 if mixed else 4
    assert got.params == pytest.approx(width * psi, rel=0.05)
    grads = width * psi if stage == 1 else width * psi / world
    assert got.grads == pytest.approx(grads, rel=0.05)
    assert got.master == pytest.approx(4 * psi / world if mixed else 0, rel=0.05, abs=64)
    assert got.optimizer_states == pytest.approx(8 * psi / world, rel=0.05)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_matches_the_zero_paper(world: int) -> None:
    pytest.importorskip("transformers")
    run_subtests(
        check_accounting, world, {"stage": [1, 2], "dtype": [torch.bfloat16, torch.float32]}
    )


# -- checkpoints across world sizes ---------------------------------------------------


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 2e-2}]


def _build(stage: int) -> tuple[nn.Module, LowLevelZeroOptimizer]:
    model = _mlp()
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(_groups(model), lr=1e-2), stage=stage, reduce_bucket_size=50
    )
    return model, opt


def save_and_continue(root: str) -> None:
    rank, out = dist.get_rank(), Path(root)
    model, opt = _build(stage=2)
    for step in range(3):
        _train_step(model, opt, step)
    full = opt.state_dict()  # a collective
    torch.save(opt.sharded_state_dict(), out / f"optim-rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), out / "model.pt")
        torch.save(full, out / "optim-full.pt")
    losses = [_train_step(model, opt, step) for step in range(3, 6)]
    if rank == 0:
        (out / "reference.json").write_text(json.dumps(losses))


def resume(root: str, source: str, stage: int) -> None:
    rank, out = dist.get_rank(), Path(root)
    model, opt = _build(stage=stage)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    if source == "sharded":
        files = sorted(out.glob("optim-rank*.pt"))
        opt.load_state_dict(
            merge_sharded_state_dicts([torch.load(f, weights_only=True) for f in files])
        )
    else:
        opt.load_state_dict(torch.load(out / "optim-full.pt", weights_only=True))
    losses = [_train_step(model, opt, step) for step in range(3, 6)]
    reference = json.loads((out / "reference.json").read_text())
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (rank, source, losses, reference)


def resume_in_torch(root: str) -> None:
    """Our full state dict loads into plain torch.optim.AdamW."""
    out = Path(root)
    model = _mlp()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    opt.load_state_dict(torch.load(out / "optim-full.pt", weights_only=True))
    reference = json.loads((out / "reference.json").read_text())
    for step, want in zip(range(3, 6), reference, strict=True):
        x, y = _batch(step)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        got = loss.item()
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (got, want)


def test_checkpoint_saved_at_two_ranks_resumes_at_four_and_one(tmp_path: Path) -> None:
    spawn(save_and_continue, 2, args=(str(tmp_path),))
    run_subtests(resume, 4, {"source": ["sharded", "full"], "stage": [1, 2]}, args=(str(tmp_path),))
    run_subtests(resume, 1, {"source": ["sharded", "full"], "stage": [1, 2]}, args=(str(tmp_path),))
    resume_in_torch(str(tmp_path))


# -- errors -------------------------------------------------------------------------


def check_errors() -> None:
    model, opt = _build(stage=2)
    with pytest.raises(RuntimeError, match="not available with ZeRO stage 2"), opt.no_sync():
        pass
    with pytest.raises(ValueError, match="merge_sharded_state_dicts"):
        opt.load_state_dict(opt.sharded_state_dict())
    with pytest.raises(ValueError, match="files of ranks"):
        merge_sharded_state_dicts([opt.sharded_state_dict()])
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        LowLevelZeroOptimizer(torch.optim.AdamW(_mlp().parameters()), stage=3)
    mixed = _mlp()
    mixed[0].half()
    with pytest.raises(ValueError, match="share one dtype"):
        LowLevelZeroOptimizer(torch.optim.AdamW(mixed.parameters()))
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=2.0)
    del model


def test_bad_input_is_explained() -> None:
    spawn(check_errors, 2)
