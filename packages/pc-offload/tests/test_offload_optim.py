"""CPUAdam, CPUAdamW and HybridAdam against torch.optim.Adam/AdamW over 10
steps: fp32 and bf16 parameters, odd sizes, several param groups, amsgrad,
and state_dict round trips."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from pc_offload import CPUAdam, CPUAdamW, HybridAdam

pytestmark = pytest.mark.timeout(120)

SHAPES = [(7, 13), (1,), (31,), (3, 5, 2), (1000,)]
STEPS = 10

Make = Callable[[list[dict[str, object]]], torch.optim.Optimizer]

OURS: dict[str, tuple[Make, Make]] = {
    # name: (ours, torch's reference)
    "CPUAdamW": (
        lambda groups: CPUAdamW(groups, lr=1e-2, weight_decay=0.1),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    ),
    "CPUAdam": (
        lambda groups: CPUAdam(groups, lr=1e-2, weight_decay=0.1),
        lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.1),
    ),
    "HybridAdam": (
        lambda groups: HybridAdam(groups, lr=1e-2, weight_decay=0.1),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    ),
    "HybridAdam-adam": (
        lambda groups: HybridAdam(groups, lr=1e-2, weight_decay=0.1, adamw_mode=False),
        lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.1),
    ),
}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params: list[torch.nn.Parameter], amsgrad: bool) -> list[dict[str, object]]:
    # Three groups with their own hyperparameters; amsgrad in the last only.
    return [
        {"params": params[:2]},
        {"params": params[2:4], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        {"params": params[4:], "eps": 1e-6, "amsgrad": amsgrad},
    ]


def _grad(step: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(shape, generator=gen)


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for i, p in enumerate(params):
            p.grad = _grad(step, i, tuple(p.shape)).to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_matches_torch_over_ten_steps(name: str, dtype: torch.dtype, amsgrad: bool) -> None:
    make_ours, make_ref = OURS[name]
    params = _params(dtype)
    # The reference steps fp32 masters with the same (bf16-rounded) gradients.
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours, ref = make_ours(_groups(params, amsgrad)), make_ref(_groups(masters, amsgrad))
    for step in range(STEPS):
        for i, (p, m) in enumerate(zip(params, masters, strict=True)):
            g = _grad(step, i, tuple(p.shape)).to(dtype)
            p.grad, m.grad = g, g.float()
        ours.step()
        ref.step()
        for p, m in zip(params, masters, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(p, m, rtol=1e-5, atol=1e-6)
            else:
                master = ours.state[p]["master"]
                torch.testing.assert_close(master, m.detach(), rtol=1e-5, atol=1e-6)
                assert torch.equal(p.detach(), master.to(dtype))  # rounded from the master
    if dtype == torch.bfloat16:  # the master kept updates bf16 cannot hold
        assert any(not torch.equal(ours.state[p]["master"], p.detach().float()) for p in params)


@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(name: str, dtype: torch.dtype) -> None:
    make_ours, _ = OURS[name]
    straight = _params(dtype)
    opt = make_ours(_groups(straight, amsgrad=True))
    _run(opt, straight, range(STEPS))

    first = _params(dtype)
    opt1 = make_ours(_groups(first, amsgrad=True))
    _run(opt1, first, range(5))
    saved = copy.deepcopy(opt1.state_dict())
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = make_ours(_groups(second, amsgrad=True))
    opt2.load_state_dict(saved)
    for p in second:
        for value in opt2.state[p].values():
            assert value.dtype == torch.float32  # moments keep fp32 even for bf16 params
    _run(opt2, second, range(5, STEPS))
    for a, b in zip(straight, second, strict=True):
        assert torch.equal(a, b)


def test_fp32_state_dict_is_torch_compatible() -> None:
    params = _params(torch.float32)
    ours = CPUAdamW(_groups(params, amsgrad=False), lr=1e-2)
    _run(ours, params, range(3))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.AdamW(_groups(twins, amsgrad=False), lr=1e-2)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch shares, not copies
    _run(ours, params, range(3, 6))
    _run(theirs, twins, range(3, 6))
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_hyperparameters_are_rejected() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="invalid learning rate: -1"):
        CPUAdam(p, lr=-1)
    with pytest.raises(ValueError, match=r"invalid betas: \(1.0, 0.9\)"):
        CPUAdamW(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="invalid weight_decay"):
        HybridAdam(p, weight_decay=-0.1)


def test_parameters_without_gradients_are_skipped() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = CPUAdamW([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(a.detach(), torch.ones(3))
    assert torch.equal(b.detach(), torch.ones(3))
    assert b not in opt.state
