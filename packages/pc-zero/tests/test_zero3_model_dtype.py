"""A model built in bf16 or fp16 under GeminiDDP and FullyShardedDataParallel
([Note: build dtype] in pc_zero.sharded): the wrapper's mixed precision
decides the compute dtype and the masters are fp32, taken from the built
values upcast exactly. So under fp32 compute it trains as
``copy.deepcopy(model).float()`` does in one process (rtol 1e-5, atol 1e-6
over 3 steps, the global batch split over 2 ranks); under bf16 (fp16)
compute it follows one process computing in that dtype with fp32 masters
from the built values, within the tolerance of the Booster's precision
tests (losses rtol 2e-2 for bf16, 5e-3 for fp16). Buffers and frozen
parameters built narrower than the compute dtype are upcast to it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero3_models import (
    batch,
    block_classes,
    build,
    chunk_size_for,
    loss_of,
    make_optimizer,
    named,
    param_groups,
    rank_slice,
)

from pc_comm.testing import run_subtests
from pc_zero import (
    FullyShardedDataParallel,
    GeminiDDP,
    GeminiOptimizer,
    LossScaleConfig,
    MixedPrecision,
    ShardedModule,
    transformer_auto_wrap_policy,
)

pytestmark = pytest.mark.timeout(600)

STEPS, GLOBAL_BATCH, LR = 3, 8, 1e-3
# The Booster's precision tests (integration_tests/test_booster_precision.py).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
SCALE = 2.0**10  # fp16 loss scale, in the reference too


def _wrap(kind: str, model: nn.Module, compute: torch.dtype) -> ShardedModule:
    """As the Booster builds them; FSDP's fp32 is its default (no MixedPrecision)."""
    if kind == "gemini":
        return GeminiDDP(
            model,
            device="cpu",
            mixed_precision=compute,
            sync_module_states=True,
            placement_policy="static",
            chunk_size=chunk_size_for(model, 4),
        )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=transformer_auto_wrap_policy(block_classes("gpt2")),
        mixed_precision=None if compute == torch.float32 else MixedPrecision(compute),
        device="cpu",
        sync_module_states=True,
    )


def _optimizer(wrapped: ShardedModule, compute: torch.dtype) -> GeminiOptimizer:
    inner = make_optimizer("adamw", param_groups(named(wrapped), LR), LR)
    scale = LossScaleConfig(initial_scale=SCALE) if compute == torch.float16 else None
    return GeminiOptimizer(inner, wrapped, loss_scale=scale)


def _check_masters_start_from(wrapped: ShardedModule, built: nn.Module) -> None:
    """The fp32 masters are the built values, upcast exactly."""
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())
    expected = dict(named(built))
    with wrapped.summon_full_params(writeback=False):
        for name, param in named(wrapped):
            assert torch.equal(param.detach(), expected[name].detach().float()), name


def _train(wrapped: ShardedModule, optimizer: GeminiOptimizer, steps: int) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = loss_of(wrapped, rank_slice(batch("gpt2", step, GLOBAL_BATCH), rank, world))
        optimizer.backward(loss.float())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().float().clone())
        losses.append(mean / world)
    return losses


def check_fp32_compute(kind: str, built: torch.dtype) -> None:
    model = build("gpt2").to(built)
    reference = copy.deepcopy(model).float()
    wrapped = _wrap(kind, model, torch.float32)
    _check_masters_start_from(wrapped, reference)
    ref_opt = make_optimizer("adamw", param_groups(named(reference), LR), LR)
    ref_losses = []
    for step in range(STEPS):
        loss = loss_of(reference, batch("gpt2", step, GLOBAL_BATCH))
        loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.detach())
    losses = _train(wrapped, _optimizer(wrapped, torch.float32), STEPS)
    for ours, theirs in zip(losses, ref_losses, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with wrapped.summon_full_params():
        ours_by_name = dict(named(wrapped))
        for name, param in named(reference):
            torch.testing.assert_close(
                ours_by_name[name].detach(), param.detach(), rtol=1e-5, atol=1e-6, msg=name
            )


def _low_precision_reference(model: nn.Module, compute: torch.dtype) -> list[float]:
    """One process computing in ``compute`` with fp32 masters taken from
    ``model``'s built values (as integration_tests/test_booster_precision.py,
    whose fp16 overflow steps are skipped with the scale halved)."""
    masters = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    model = copy.deepcopy(model).to(compute)
    params = list(model.parameters())
    named_masters = list(zip(_names(model), masters, strict=True))
    optimizer = make_optimizer("adamw", param_groups(named_masters, LR), LR)
    scale = SCALE if compute == torch.float16 else 1.0
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, batch("gpt2", step, GLOBAL_BATCH))
        (loss.float() * scale).backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.float() / scale for p in params]  # type: ignore[union-attr]
        for p in params:
            p.grad = None
        losses.append(loss.item())
        if not all(torch.isfinite(g).all() for g in grads):
            scale /= 2
            continue
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return losses


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def check_low_precision_compute(kind: str, compute: torch.dtype) -> None:
    model = build("gpt2").to(torch.bfloat16)
    built = copy.deepcopy(model)
    expected = _low_precision_reference(built, compute)
    wrapped = _wrap(kind, model, compute)
    _check_masters_start_from(wrapped, built)
    losses = [float(x) for x in _train(wrapped, _optimizer(wrapped, compute), STEPS)]
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(expected),
        rtol=TOLERANCE[compute],
        atol=0.0,
        msg=lambda m: f"{kind} {compute}: {m} ours {losses} reference {expected}",
    )


class _WithBufferAndFrozen(nn.Module):
    """A trainable layer, a frozen one and a floating buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(8, 8)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.trained(self.frozen(x) + self.shift).square().mean()
        return out


def check_whole_tensors_upcast(kind: str, compute: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _WithBufferAndFrozen().to(torch.bfloat16)
    built = copy.deepcopy(model)
    if kind == "gemini":
        wrapped: ShardedModule = GeminiDDP(model, device="cpu", mixed_precision=compute)
    else:
        mp = None if compute == torch.float32 else MixedPrecision(compute)
        wrapped = FullyShardedDataParallel(model, mixed_precision=mp, device="cpu")
    wider = torch.promote_types(torch.bfloat16, compute)
    for name in ("shift", "frozen.weight"):
        tensor, original = model.state_dict()[name], built.state_dict()[name]
        assert tensor.dtype == wider
        assert torch.equal(tensor, original.to(wider))  # exact
    loss = wrapped(torch.ones(2, 8))
    assert loss.dtype == compute
    loss.float().backward()


def test_fp32_compute_matches_the_model_cast_to_fp32() -> None:
    run_subtests(
        check_fp32_compute,
        2,
        {"kind": ["gemini", "fsdp"], "built": [torch.bfloat16, torch.float16]},
        timeout=500,
    )


def test_low_precision_compute_of_a_bf16_built_model() -> None:
    run_subtests(
        check_low_precision_compute,
        2,
        {"kind": ["gemini", "fsdp"], "compute": [torch.bfloat16, torch.float16]},
        timeout=500,
    )


def test_buffers_and_frozen_parameters_are_upcast() -> None:
    run_subtests(
        check_whole_tensors_upcast,
        2,
        {"kind": ["gemini", "fsdp"], "compute": [torch.float32, torch.bfloat16]},
    )
