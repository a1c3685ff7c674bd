"""Adam's moments stored in bf16 and 8 bits [Note: low-precision optimizer
states]: each step against a reference implementation of the format, the
bytes kept, and checkpoints that load across formats."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pc_offload import CPUAdam, CPUAdamW, HybridAdam, StateDtype, parse_state_dtype

LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 64 x 128 = 8192 values (8-bit), the bias (128) keeps fp32 under int8.
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 128))


def _grads(model: nn.Module, step: int) -> None:
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to fp32 rounding except where a moment sat on a rounding
    boundary of its format and the two implementations' last fp32 bit put
    it on different sides: at most 0.5 % of the values, each off by about
    one level of the format times the learning rate."""
    off = (got - want).abs() > 1e-6 + 1e-5 * want.abs()
    assert float(off.float().mean()) <= 0.005, f"{what}: {int(off.sum())} values differ"
    torch.testing.assert_close(got, want, rtol=0, atol=LR * 2**-5, msg=lambda m: f"{what}: {m}")


def _bf16_reference(model: nn.Module, steps: int) -> list[torch.Tensor]:
    """AdamW computed in fp32 with the moments rounded to bf16 between steps."""
    params = list(model.parameters())
    m = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    v = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    for step in range(1, steps + 1):
        _grads(model, step)
        with torch.no_grad():
            for i, p in enumerate(params):
                assert p.grad is not None
                g = p.grad
                m32 = m[i].float().lerp(g, 1 - BETAS[0])
                v32 = v[i].float() * BETAS[1] + (1 - BETAS[1]) * g * g
                p.mul_(1 - LR * DECAY)
                denom = v32.sqrt() / (1 - BETAS[1] ** step) ** 0.5 + EPS
                p.add_(m32 / denom, alpha=-LR / (1 - BETAS[0] ** step))
                m[i], v[i] = m32.bfloat16(), v32.bfloat16()
                p.grad = None
    return [p.detach().clone() for p in params]


def _pc(model: nn.Module, steps: int, state_dtype: str, cls: Any = CPUAdamW) -> Any:
    opt = cls(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
              state_dtype=state_dtype)  # fmt: skip
    for step in range(1, steps + 1):
        _grads(model, step)
        opt.step()
        opt.zero_grad()
    return opt


def test_bf16_moments_match_adamw_with_moments_rounded_to_bf16() -> None:
    ref, mine = _model(), _model()
    expected = _bf16_reference(ref, 5)
    opt = _pc(mine, 5, "bf16")
    for i, (p, e) in enumerate(zip(mine.parameters(), expected, strict=True)):
        _agree(p.detach(), e, f"param {i}")
    moments = [v for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments
    assert all(v.dtype == torch.bfloat16 for v in moments)


def test_int8_moments_match_torchaos_8bit_adamw_step_by_step() -> None:
    """The reference: torchao's own AdamW step on its 8-bit states, run
    eagerly (its optimizer compiles the same function). Each step starts
    both from the same parameters and states (the reference's), so what is
    compared is one update, not rounding carried over steps."""
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    ref, mine = _model(), _model()
    opt = CPUAdamW(mine.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                   state_dtype="int8")  # fmt: skip
    states: dict[int, tuple[Any, Any]] = {}
    for i, p in enumerate(ref.parameters()):
        if p.numel() >= 4096:
            states[i] = (OptimState8bit.zeros(p.shape, signed=True),
                         OptimState8bit.zeros(p.shape, signed=False))  # fmt: skip
        else:
            states[i] = (torch.zeros_like(p), torch.zeros_like(p))
    for step in range(1, 6):
        _grads(ref, step)
        _grads(mine, step)
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(ref.parameters(), mine.parameters(), strict=True)):
                q.copy_(p)  # the same start
                if step > 1:
                    for name, theirs in zip(("exp_avg", "exp_avg_sq"), states[i], strict=True):
                        ours = opt.state[q][name]
                        for part in ("codes", "scale") if hasattr(ours, "codes") else ():
                            getattr(ours, part).copy_(getattr(theirs, part))
                        if not hasattr(ours, "codes"):
                            ours.copy_(theirs)
            for i, p in enumerate(ref.parameters()):
                assert p.grad is not None
                lr, count = torch.tensor(LR), torch.tensor(float(step))
                b1, b2 = BETAS
                single_param_adam(
                    p.detach(), p.grad, count, *states[i], None, lr, b1, b2, DECAY, EPS, True, False
                )
                p.grad = None
        opt.step()
        opt.zero_grad()
        for (i, p), q in zip(enumerate(ref.parameters()), mine.parameters(), strict=True):
            where = f"step {step}, param {i}"
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=where)
            for name, theirs in zip(("exp_avg", "exp_avg_sq"), states[i], strict=True):
                ours = opt.state[q][name]
                if hasattr(ours, "codes"):  # the same codes, but where fp32 rounding tips one
                    moved = ours.codes.int() - theirs.codes.int()
                    assert moved.abs().max() <= 1, (step, i, name)
                    assert float((moved != 0).float().mean()) < 0.002, (step, i, name)
                    torch.testing.assert_close(ours.scale, theirs.scale, rtol=1e-5, atol=0)


def test_bytes_kept_per_moment_value() -> None:
    def nbytes(state_dtype: str) -> int:
        opt = _pc(_model(), 1, state_dtype)
        total = 0
        for s in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                v = s[key]
                parts = (v.codes, v.scale) if hasattr(v, "codes") else (v,)
                total += sum(t.numel() * t.element_size() for t in parts)
        return total

    values = 2 * sum(p.numel() for p in _model().parameters())
    assert nbytes("fp32") == 4 * values
    assert nbytes("bf16") == 2 * values
    big = 2 * (128 * 64 + 64 * 128)  # the weights are 8-bit, the biases fp32
    assert nbytes("int8") == big * (1 + 4 / 256) + 4 * (values - big)


@pytest.mark.parametrize("saved", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("loaded", ["fp32", "bf16", "int8"])
def test_a_checkpoint_loads_into_any_format(saved: str, loaded: str) -> None:
    model = _model()
    opt = _pc(model, 3, saved)
    state = opt.state_dict()
    assert {g["state_dtype"] for g in state["param_groups"]} == {saved}
    widths = {v.dtype for s in state["state"].values() for v in s.values()}
    assert widths == {torch.float32}, "checkpoints hold fp32 moments"
    other = CPUAdamW(copy.deepcopy(model).parameters(), lr=LR, state_dtype=loaded)
    other.load_state_dict(state)
    assert {g["state_dtype"] for g in other.param_groups} == {loaded}
    back = other.state_dict()
    bound = {"fp32": 0.0, "bf16": 2**-8, "int8": 0.05}[loaded]
    for key, entry in state["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            want, got = entry[name], back["state"][key][name]
            scale = want.abs().max().clamp_min(1e-30)
            assert float((got - want).abs().max() / scale) <= bound, (saved, loaded, name)
    # and it steps on from there
    _grads(model, 9)
    other.step()


def test_every_cpu_adam_takes_the_option_and_refuses_an_unknown_one() -> None:
    for cls in (CPUAdam, CPUAdamW, HybridAdam):
        opt = cls(_model().parameters(), state_dtype="bf16")
        assert opt.state_dtype is StateDtype.BF16
    assert parse_state_dtype(torch.bfloat16) is StateDtype.BF16
    with pytest.raises(ValueError, match="'fp32', 'bf16', 'int8'"):
        CPUAdamW(_model().parameters(), state_dtype="fp8")


def test_amsgrad_and_no_bias_correction_in_8_bits() -> None:
    """The other update paths run through the same blocks: they match the
    fp32 run to within the format's rounding."""
    options: list[dict[str, Any]] = [{"amsgrad": True}, {"bias_correction": False}]
    for kwargs in options:
        exact, narrow = _model(), _model()
        for model, dtype in ((exact, "fp32"), (narrow, "int8")):
            opt = CPUAdam(model.parameters(), lr=1e-3, state_dtype=dtype, **kwargs)
            for step in range(3):
                _grads(model, step)
                opt.step()
                opt.zero_grad()
        weight = next(iter(narrow.parameters()))
        assert all(hasattr(v, "codes") for k, v in opt.state[weight].items() if k != "step")
        # Three steps of 1e-3 move a value by up to 3e-3: within a fifth of that.
        for p, q in zip(exact.parameters(), narrow.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=6e-4)
