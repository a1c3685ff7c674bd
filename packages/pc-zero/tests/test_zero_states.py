"""ZeRO-1/2 with Adam's moments in bf16 and 8 bits (``optimizer_states``,
pc_offload [Note: low-precision optimizer states]): parity with one process
keeping its moments the same way, the bytes a rank keeps, checkpoints that
resume exactly and load across formats, and the refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests
from pc_offload import CPUAdamW
from pc_zero import LowLevelZeroOptimizer

pytestmark = pytest.mark.timeout(300)

LR = 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))


def _loss(model: nn.Module, step: int, part: slice) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
    loss: torch.Tensor = (model(x[part]) - y[part]).square().mean()
    return loss


def _mine() -> slice:
    return slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)


def _zero(model: nn.Module, stage: int, states: str, **kw: Any) -> LowLevelZeroOptimizer:
    kw.setdefault("reduce_bucket_size", 4096)
    return LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), stage=stage, optimizer_states=states, **kw
    )


def _train(model: nn.Module, opt: LowLevelZeroOptimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, step, _mine())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def check_bf16_matches_one_process_with_bf16_moments(stage: int, offload: bool) -> None:
    ref, mine = _model(), _model()
    ref_opt = CPUAdamW(ref.parameters(), lr=LR, state_dtype="bf16")
    opt = _zero(mine, stage, "bf16", cpu_offload=offload)
    losses = _train(mine, opt, range(4))
    for step in range(4):
        ref_loss = _loss(ref, step, slice(0, 8))
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(losses[step] - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), step
    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        # The reduce-scatter's average and one process's gradient differ in
        # the last fp32 bit; a moment on a bf16 rounding boundary can tip.
        off = (p - q).abs() > 1e-6 + 1e-5 * p.abs()
        assert float(off.float().mean()) <= 0.005
        torch.testing.assert_close(q, p, rtol=0, atol=LR * 2**-5)
    moments = [v for s in opt.inner.state.values() for k, v in s.items() if "exp_avg" in k]
    assert moments
    assert all(v.dtype == torch.bfloat16 for v in moments)


def check_int8_trains_close_to_fp32_and_keeps_a_quarter(stage: int) -> None:
    exact, narrow = _model(), _model()
    exact_opt = _zero(exact, stage, "fp32")
    # One bucket: a piece of 8-bit moments holds at least 4096 values
    # (smaller tensors keep fp32 moments, as torchao's rule has it).
    opt = _zero(narrow, stage, "int8", reduce_bucket_size=1 << 20)
    losses = _train(narrow, opt, range(12))
    gap = [a - b for a, b in zip(losses, _train(exact, exact_opt, range(12)), strict=True)]
    assert max(abs(g) for g in gap) < 0.02, gap
    assert all(b.piece % 256 == 0 for b in opt.buckets)
    assert all(hasattr(opt.inner.state[m]["exp_avg"], "codes") for m in opt.masters)
    kept = opt.memory().optimizer_states
    pieces = sum(b.piece for b in opt.buckets)
    assert kept == 2 * pieces * (1 + 4 / 256) + 4 * len(opt.buckets)  # + the step counters


def check_resume_is_exact_and_loads_across_formats(stage: int, saved: str) -> None:
    model = _model()
    opt = _zero(model, stage, saved, reduce_bucket_size=1 << 20)
    _train(model, opt, range(3))
    state = copy.deepcopy(opt.state_dict())  # its step counters are the live ones, as torch's
    assert {g.get("state_dtype", "fp32") for g in state["param_groups"]} == {saved}
    after = copy.deepcopy(model.state_dict())
    went_on = _train(model, opt, range(3, 6))
    for loaded in ("fp32", "bf16", "int8"):
        again = _model()
        again.load_state_dict(after)
        resumed = _zero(again, stage, loaded, reduce_bucket_size=1 << 20)
        resumed.load_state_dict(copy.deepcopy(state))  # torch shares what it loads
        losses = _train(again, resumed, range(3, 6))
        if loaded == saved:  # bitwise: the same run
            assert losses == went_on, (saved, losses, went_on)
            for p, q in zip(model.parameters(), again.parameters(), strict=True):
                assert torch.equal(p, q)
        else:  # another format from the same fp32 moments
            gap = max(abs(a - b) for a, b in zip(losses, went_on, strict=True))
            assert gap < 0.02, (saved, loaded)
    plain = torch.optim.AdamW(_model().parameters(), lr=LR)
    plain.load_state_dict(state)  # the fp32 moments a torch AdamW reads


def check_the_sharded_pieces_of_8_bit_moments(stage: int) -> None:
    """Sharded checkpoints read and write pieces of fp32 moments; 8-bit ones
    are widened for them and stored 8-bit again at the next step."""
    model = _model()
    opt = _zero(model, stage, "int8", reduce_bucket_size=1 << 20)
    _train(model, opt, range(2))
    before = opt.state_dict()
    pieces = opt.owned_pieces()
    assert all(v.dtype == torch.float32 for piece in pieces for v in piece.state.values())
    for piece in pieces:
        for view in piece.state.values():
            view.mul_(1.0)  # what a load writes
    torch.testing.assert_close(opt.state_dict()["state"], before["state"], rtol=0, atol=0)
    _train(model, opt, range(2, 3))
    assert all(hasattr(opt.inner.state[m]["exp_avg"], "codes") for m in opt.masters)


def test_zero_optimizer_states() -> None:
    run_subtests(check_bf16_matches_one_process_with_bf16_moments, 2,
                 {"stage": [1, 2], "offload": [False, True]})  # fmt: skip
    run_subtests(check_int8_trains_close_to_fp32_and_keeps_a_quarter, 2, {"stage": [1, 2]})
    run_subtests(check_resume_is_exact_and_loads_across_formats, 2,
                 {"stage": [2], "saved": ["fp32", "bf16", "int8"]})  # fmt: skip
    run_subtests(check_the_sharded_pieces_of_8_bit_moments, 2, {"stage": [2]})


def check_refusals() -> None:
    model = _model()
    with pytest.raises(ValueError, match="SGD"):
        LowLevelZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), stage=2, optimizer_states="bf16"
        )
    with pytest.raises(ValueError, match="'fp32', 'bf16', 'int8'"):
        _zero(model, 2, "fp8")
    with pytest.raises(ValueError, match="state_dtype='int8'"):
        LowLevelZeroOptimizer(
            CPUAdamW(model.parameters(), state_dtype="bf16"), stage=2, optimizer_states="int8"
        )


def test_refusals() -> None:
    run_subtests(check_refusals, 2, {})
