"""HybridAdam and CPUAdam on parameters sharded by torch's FSDP2
(``fully_shard``: DTensor parameters and gradients), world 2, gloo, CPU
([Note: DTensor parameters] in pc_offload.optim). fp32 parameters step as
torch.optim.AdamW/Adam on the same sharded model does (rtol 1e-5, atol
1e-6, over 3 steps); bf16 parameters step exactly as the same optimizer
on plain bf16 tensors holding the local shards, with fp32 masters. The
states are DTensors laid out as the parameters, and state dict round
trips (the optimizer's own, and torch.distributed.checkpoint's full,
name-keyed one) keep them so, in fp32."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pc_comm.testing import run_subtests
from pc_offload import CPUAdam, HybridAdam

pytestmark = pytest.mark.timeout(300)

STEPS = 3
Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, tuple[Make, Make]] = {
    # name: (ours, torch's reference)
    "HybridAdam": (
        lambda ps: HybridAdam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
    "CPUAdam": (
        lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    ),
}


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _sharded(dtype: torch.dtype, param_dtype: torch.dtype | None) -> nn.Module:
    """Blocks and root sharded as pc_booster's TorchFSDPPlugin does. Odd
    sizes shard unevenly; the head's (1, 7) weight leaves rank 1 an empty
    shard."""
    torch.manual_seed(0)
    blocks = [Block(8, 13), Block(13, 7)]
    model = nn.Sequential(*blocks, nn.Linear(7, 1)).to(dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _backward(model: nn.Module, step: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(4, 8, generator=gen).to(dtype)
    model(x).float().square().mean().backward()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return tensor.to_local()


def check_fp32_matches_torch(name: str, param_dtype: torch.dtype | None) -> None:
    make_ours, make_ref = OPTIMIZERS[name]
    model, reference = _sharded(torch.float32, param_dtype), _sharded(torch.float32, param_dtype)
    params, ref_params = list(model.parameters()), list(reference.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    ours, ref = make_ours(params), make_ref(ref_params)
    for step in range(STEPS):
        for m, opt in ((model, ours), (reference, ref)):
            _backward(m, step, torch.float32)
            opt.step()
            opt.zero_grad()
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(_local(p), _local(r), rtol=1e-5, atol=1e-6)
    for p in params:  # fp32 parameters are their own masters
        assert "master" not in ours.state[p]
        _check_laid_out_as(p, ours.state[p]["exp_avg"])


def _check_laid_out_as(param: torch.Tensor, state: torch.Tensor) -> None:
    assert isinstance(param, DTensor)
    assert isinstance(state, DTensor)
    assert state.placements == param.placements
    assert state.shape == param.shape
    assert state.dtype == torch.float32
    assert state.to_local().shape == param.to_local().shape


def check_bf16_matches_plain_tensors(name: str, param_dtype: torch.dtype | None) -> None:
    make_ours, _ = OPTIMIZERS[name]
    model = _sharded(torch.bfloat16, param_dtype)
    params = list(model.parameters())
    plain = [nn.Parameter(_local(p).detach().clone()) for p in params]
    ours, ref = make_ours(params), make_ours(plain)
    for step in range(STEPS):
        _backward(model, step, torch.bfloat16)
        for p, q in zip(params, plain, strict=True):
            assert p.grad is not None
            q.grad = _local(p.grad).clone()
        ours.step()
        ref.step()
        ours.zero_grad()
        for p, q in zip(params, plain, strict=True):
            assert isinstance(p, DTensor)
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.to_local(), q.detach())
            master = ours.state[p]["master"]
            _check_laid_out_as(p, master)
            assert torch.equal(master.to_local(), ref.state[q]["master"])
    # The masters kept updates bf16 cannot hold.
    assert any(
        not torch.equal(ours.state[p]["master"].to_local(), _local(p).float()) for p in params
    )
    # A state dict round trip keeps fp32 DTensor states.
    again = make_ours(params)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    _check_same_states(ours, again, params, params)
    # So does torch.distributed.checkpoint's full state dict (name-keyed,
    # gathered as the parameters are), loaded into a fresh sharded model.
    options = StateDictOptions(full_state_dict=True)
    full = get_optimizer_state_dict(model, ours, options=options)
    names = dict(model.named_parameters())
    states: dict[str, dict[str, torch.Tensor]] = full["state"]  # type: ignore[assignment]
    for name, state in states.items():
        assert state["master"].shape == names[name].shape  # whole, not a shard
        assert state["master"].dtype == torch.float32
    fresh = _sharded(torch.bfloat16, param_dtype)
    loaded = make_ours(list(fresh.parameters()))
    set_optimizer_state_dict(fresh, loaded, full, options=options)
    _check_same_states(ours, loaded, params, list(fresh.parameters()))


def _check_same_states(
    a: torch.optim.Optimizer,
    b: torch.optim.Optimizer,
    a_params: list[nn.Parameter],
    b_params: list[nn.Parameter],
) -> None:
    for p, q in zip(a_params, b_params, strict=True):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            _check_laid_out_as(q, b.state[q][key])
            assert torch.equal(b.state[q][key].to_local(), a.state[p][key].to_local()), key
        assert torch.equal(b.state[q]["step"], a.state[p]["step"])


CASES: dict[str, list[object]] = {
    "name": list(OPTIMIZERS),
    "param_dtype": [None, torch.bfloat16],
}


def test_fsdp2_fp32_parameters_step_as_torch() -> None:
    run_subtests(check_fp32_matches_torch, 2, CASES)


def test_fsdp2_bf16_parameters_step_on_local_shards() -> None:
    run_subtests(check_bf16_matches_plain_tensors, 2, CASES)
