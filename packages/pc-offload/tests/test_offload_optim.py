"""CPUAdam, CPUAdamW and HybridAdam against torch.optim.Adam/AdamW over 10
steps: fp32 and bf16 parameters, odd sizes, several param groups, amsgrad,
and state_dict round trips; Colossal-AI's arguments (adamw_mode,
bias_correction, their positional order, the refused NVMe offload) against
a hand-written Adam."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

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
    "CPUAdam": (  # adamw_mode=True by default, as Colossal-AI's
        lambda groups: CPUAdam(groups, lr=1e-2, weight_decay=0.1),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    ),
    "CPUAdam-adam": (
        lambda groups: CPUAdam(groups, lr=1e-2, weight_decay=0.1, adamw_mode=False),
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


def test_torch_state_dict_loads_and_steps() -> None:
    # torch's groups lack bias_correction: the loaded groups take the default.
    params = _params(torch.float32)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.AdamW(_groups(twins, amsgrad=False), lr=1e-2)
    _run(theirs, twins, range(3))
    ours = CPUAdam(_groups(params, amsgrad=False), lr=1e-2)
    for p, t in zip(params, twins, strict=True):
        p.data.copy_(t.detach())
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert all(g["bias_correction"] is True for g in ours.param_groups)
    _run(ours, params, range(3, 6))
    _run(theirs, twins, range(3, 6))
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- Colossal-AI's arguments --------------------------------------------------------


def _reference_adam(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    correct: list[bool],
    amsgrad: bool = False,
    maximize: bool = False,
) -> list[torch.Tensor]:
    """Adam written out from the paper's formulas, in float64, one tensor at
    a time: ``grads[step][i]`` for parameter ``i``; ``correct[i]`` whether
    parameter ``i``'s moments are bias-corrected."""
    beta1, beta2 = betas
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    vmax = [torch.zeros_like(p) for p in ps]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            g = -g.double() if maximize else g.double()
            if decoupled:
                ps[i] = ps[i] * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * ps[i]
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            vmax[i] = torch.maximum(vmax[i], vs[i])
            v = vmax[i] if amsgrad else vs[i]
            c1 = 1 - beta1**t if correct[i] else 1.0
            c2 = 1 - beta2**t if correct[i] else 1.0
            ps[i] = ps[i] - lr / c1 * ms[i] / (v.sqrt() / math.sqrt(c2) + eps)
    return ps


def _steps_of(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> list[list[torch.Tensor]]:
    grads = [[_grad(s, i, tuple(p.shape)) for i, p in enumerate(params)] for s in range(STEPS)]
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return grads


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("variant", ["plain", "amsgrad", "maximize"])
def test_colossal_arguments_match_hand_written_adam(
    cls: type[CPUAdam], adamw_mode: bool, bias_correction: bool, variant: str
) -> None:
    params = _params(torch.float32)
    before = [p.detach().clone() for p in params]
    # Colossal-AI's positional order: lr, bias_correction, betas, eps,
    # weight_decay, adamw_mode.
    opt = cls(
        params, 1e-2, bias_correction, (0.8, 0.95), 1e-6, 0.1, adamw_mode,
        amsgrad=variant == "amsgrad", maximize=variant == "maximize",
    )  # fmt: skip
    grads = _steps_of(opt, params)
    expected = _reference_adam(
        before, grads, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
        decoupled=adamw_mode, correct=[bias_correction] * len(params),
        amsgrad=variant == "amsgrad", maximize=variant == "maximize",
    )  # fmt: skip
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e.float(), rtol=1e-5, atol=1e-6)


def test_bias_correction_per_group_and_on_cpu_adamw() -> None:
    params = _params(torch.float32)
    before = [p.detach().clone() for p in params]
    groups: list[dict[str, object]] = [
        {"params": params[:2], "bias_correction": True},
        {"params": params[2:]},
    ]
    opt = CPUAdamW(groups, lr=1e-2, weight_decay=0.1, bias_correction=False)
    grads = _steps_of(opt, params)
    correct = [True, True] + [False] * (len(params) - 2)
    expected = _reference_adam(
        before, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
        decoupled=True, correct=correct,
    )  # fmt: skip
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_adamw_mode_changes_the_update(cls: type[CPUAdam]) -> None:
    # The default is AdamW; with decay the two modes must part.
    finals = []
    for adamw_mode in (None, False):
        params = _params(torch.float32)
        if adamw_mode is None:
            opt = cls(params, lr=1e-2, weight_decay=0.1)
        else:
            opt = cls(params, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
        _run(opt, params, range(STEPS))
        finals.append(params)
    assert any(not torch.allclose(a, b) for a, b in zip(*finals, strict=True))


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_nvme_fraction_out_of_range_is_refused_and_an_unused_dir_is_accepted(
    cls: type[CPUAdam], tmp_path: Path
) -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=r"nvme_offload_fraction must be in \[0, 1\], got 1.5"):
        cls(p, nvme_offload_fraction=1.5, nvme_offload_dir=str(tmp_path))
    # A directory without a fraction offloads nothing, in Colossal-AI too.
    opt = cls(p, nvme_offload_fraction=0.0, nvme_offload_dir=str(tmp_path))
    p[0].grad = torch.ones(2)
    opt.step()
    assert not any(tmp_path.iterdir())


def test_torch_ordered_positional_call_is_refused() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(TypeError, match=r"bias_correction .*got \(0.9, 0.99\).*betas=\.\.\."):
        CPUAdam(p, 1e-3, (0.9, 0.99))  # type: ignore[arg-type]
    CPUAdamW(p, 1e-3, (0.9, 0.99))  # CPUAdamW keeps torch's order
