"""bf16 masters with stochastic rounding (``bf16_stochastic_round``,
[Note: low-precision optimizer states] in pc_offload.states): the rounding
is unbiased; a bf16 model keeps no fp32 copy and tracks fp32-master
training where round-to-nearest loses every update; a resumed run rounds
as the uninterrupted one; checkpoints cross between the two kinds of
master."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pc_offload import CPUAdam, CPUAdamW, HybridAdam
from pc_offload.states import round_stochastic_, rounding_generator


def test_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    lower = torch.tensor(1.0, dtype=torch.bfloat16)
    upper = torch.tensor(1.0 + 2**-7, dtype=torch.bfloat16)  # bf16's next value after 1
    for share in (0.1, 0.5, 0.9):
        value = torch.full((200_000,), 1.0 + share * 2**-7)
        out = torch.empty(value.shape, dtype=torch.bfloat16)
        round_stochastic_(out, value, torch.Generator().manual_seed(0))
        assert set(torch.unique(out).tolist()) <= {float(lower), float(upper)}
        # The share rounded up is the value's distance from the lower one
        # (binomial: 4 standard deviations of 200,000 draws is under 0.5 %).
        assert float((out == upper).float().mean()) == pytest.approx(share, abs=0.005)
    exact = torch.tensor([0.0, -3.5, 1.0, float("inf")])
    out = torch.empty(4, dtype=torch.bfloat16)
    round_stochastic_(out, exact, torch.Generator().manual_seed(1))
    assert out.float().tolist() == exact.tolist()  # representable values stay


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(dtype)


def _batches(steps: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g)
        out.append((x, x[:, :4].sum(dim=1, keepdim=True).sin()))
    return out


def _train(model: nn.Module, opt: Any, steps: range) -> list[float]:
    losses = []
    dtype = next(model.parameters()).dtype
    for x, y in _batches(steps):
        loss = (model(x.to(dtype)).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_bf16_masters_track_fp32_masters_where_rounding_to_nearest_stalls() -> None:
    """lr 3e-5 against weights of about 0.1: Adam's updates (about lr) are
    under half bf16's spacing there (about 4e-4), so a bf16 parameter
    stepped with round-to-nearest mostly never moves; stochastic rounding
    keeps them on average. Measured: fp32 masters move the weights 0.172
    (L2) and drop the loss by 0.048; stochastic rounding ends 0.063 from
    them with the same drop; round-to-nearest moves 0.037 and drops 0.015."""
    steps, lr = range(400), 3e-5
    start = [p.detach().float().clone() for p in _model(torch.bfloat16).parameters()]
    fp32_master = _model(torch.bfloat16)
    reference = _train(fp32_master, CPUAdamW(fp32_master.parameters(), lr=lr), steps)
    sr = _model(torch.bfloat16)
    opt = CPUAdamW(sr.parameters(), lr=lr, bf16_stochastic_round=True)
    rounded = _train(sr, opt, steps)
    nearest = _model(torch.bfloat16)
    stalled = _train(nearest, torch.optim.AdamW(nearest.parameters(), lr=lr), steps)
    assert all("master" not in opt.state[p] for p in sr.parameters())  # no fp32 copy
    assert all(p.dtype == torch.bfloat16 for p in sr.parameters())

    def drop(losses: list[float]) -> float:  # the first 50 steps' mean less the last 50's
        return (sum(losses[:50]) - sum(losses[-50:])) / 50

    def distance(a: nn.Module | list[torch.Tensor], b: nn.Module | list[torch.Tensor]) -> float:
        xs = list(a.parameters()) if isinstance(a, nn.Module) else a
        ys = list(b.parameters()) if isinstance(b, nn.Module) else b
        with torch.no_grad():
            pairs = zip(xs, ys, strict=True)
            return float(sum(((x.float() - y.float()) ** 2).sum() for x, y in pairs) ** 0.5)

    moved = distance(fp32_master, start)
    assert drop(reference) > 0.03
    assert moved > 0.1
    assert abs(drop(rounded) - drop(reference)) < 0.1 * drop(reference)
    assert distance(sr, fp32_master) < 0.5 * moved
    assert drop(stalled) < 0.5 * drop(reference)
    assert distance(nearest, start) < 0.3 * moved


@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW, HybridAdam])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_resumed_run_rounds_as_the_uninterrupted_one(cls: type[Any], state_dtype: str) -> None:
    whole = _model(torch.bfloat16)
    opt = cls(whole.parameters(), lr=1e-3, bf16_stochastic_round=True, state_dtype=state_dtype)
    _train(whole, opt, range(6))
    half = _model(torch.bfloat16)
    first = cls(half.parameters(), lr=1e-3, bf16_stochastic_round=True, state_dtype=state_dtype)
    _train(half, first, range(3))
    saved_model, saved_opt = copy.deepcopy(half.state_dict()), copy.deepcopy(first.state_dict())
    resumed = _model(torch.bfloat16)
    resumed.load_state_dict(saved_model)
    second = cls(resumed.parameters(), lr=1e-3, bf16_stochastic_round=True, state_dtype=state_dtype)
    second.load_state_dict(saved_opt)
    _train(resumed, second, range(3, 6))
    for p, q in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_checkpoints_cross_between_fp32_and_bf16_masters() -> None:
    fp32_master = _model(torch.bfloat16)
    wide = CPUAdamW(fp32_master.parameters(), lr=1e-3)
    _train(fp32_master, wide, range(3))
    assert all("master" in wide.state[p] for p in fp32_master.parameters())
    narrow_model = copy.deepcopy(fp32_master)
    narrow = CPUAdamW(narrow_model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    narrow.load_state_dict(wide.state_dict())
    assert all("master" not in narrow.state[p] for p in narrow_model.parameters())
    _train(narrow_model, narrow, range(3, 5))
    back_model = copy.deepcopy(narrow_model)
    back = CPUAdamW(back_model.parameters(), lr=1e-3)
    back.load_state_dict(narrow.state_dict())
    for p in back_model.parameters():  # an fp32 master made from the bf16 weights
        assert torch.equal(back.state[p]["master"], p.float())
    _train(back_model, back, range(5, 7))
    assert all(torch.isfinite(p).all() for p in back_model.parameters())


def test_fp32_parameters_are_untouched_by_the_option() -> None:
    plain, flagged = _model(torch.float32), _model(torch.float32)
    expected = _train(plain, CPUAdamW(plain.parameters(), lr=1e-3), range(5))
    got = _train(flagged, CPUAdamW(flagged.parameters(), lr=1e-3, bf16_stochastic_round=True),
                 range(5))  # fmt: skip
    assert got == expected


def test_the_rounding_bits_depend_on_step_and_position_only() -> None:
    a = torch.randint(0, 1 << 30, (8,), generator=rounding_generator(torch.device("cpu"), 3, 1))
    b = torch.randint(0, 1 << 30, (8,), generator=rounding_generator(torch.device("cpu"), 3, 1))
    c = torch.randint(0, 1 << 30, (8,), generator=rounding_generator(torch.device("cpu"), 4, 1))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    with pytest.raises(TypeError, match="bf16_stochastic_round must be True or False"):
        CPUAdamW(_model(torch.bfloat16).parameters(), bf16_stochastic_round="yes")  # type: ignore[arg-type]
