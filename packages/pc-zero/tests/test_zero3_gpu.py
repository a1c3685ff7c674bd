"""ZeRO-3 on CUDA with shards on the host: GeminiDDP with half the chunks
offloaded (pinned host shards, prefetch copies on the copy engine's side
stream, HybridAdam stepping host shards on the host and device shards on
the device, at one rank; also stepping each chunk in backward) and
FullyShardedDataParallel with offload_params, against
plain single-process training on the GPU. One rank, and two ranks sharing
the one GPU a lent machine has. Stepping in backward is also compared with
stepping after backward for both wrappers, fp32 and bf16, with a delay
queued on the GPU before every reduction so a missing stream wait shows.
Runs with `nox -s gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero3_models import chunk_size_for

from pc_chunk import Chunk
from pc_comm.testing import run_subtests
from pc_offload import HybridAdam
from pc_zero import (
    FullyShardedDataParallel,
    GeminiDDP,
    GeminiOptimizer,
    MixedPrecision,
    ShardedModule,
    transformer_auto_wrap_policy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS, GLOBAL_BATCH = 6, 16
# Adam on the host and on the device round differently; at 1e-2 that noise
# in a near-zero gradient's update exceeded 1e-6 on an H100.
ADAM_LR, SGD_LR = 1e-3, 1e-2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(128), nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + torch.tanh(self.fc(self.norm(x)))
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), *[_Block() for _ in range(6)], nn.Linear(128, 10))


def _batch(step: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=gen)
    return x.to(device), torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen).to(device)


def check_offloaded_zero3_on_cuda(kind: str, prefetch: bool) -> None:
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model().cuda()
    # One rank computes the reference's gradients exactly, so Adam is
    # compared. Two ranks average two halves, and Adam's first steps turn
    # that rounding in a near-zero gradient into a step of the full lr; SGD
    # with momentum keeps the comparison about the sharding.
    ref_opt: torch.optim.Optimizer = (
        torch.optim.AdamW(reference.parameters(), lr=ADAM_LR)
        if world == 1
        else torch.optim.SGD(reference.parameters(), lr=SGD_LR, momentum=0.9)
    )
    model = _model()
    wrapped: nn.Module
    if kind.startswith("gemini"):
        wrapped = GeminiDDP(
            model.cuda(),
            device="cuda",
            placement_policy="static",
            offload_param_frac=0.5,
            chunk_size=chunk_size_for(model, 6),
            prefetch=prefetch,
            step_in_backward=kind == "gemini-step-in-backward",
        )
        on_host = [c for c in wrapped.chunks if not c.shard_on_device]
        assert on_host
        assert len(on_host) < len(wrapped.chunks)
        assert all(c.shard is not None and c.shard.is_pinned() for c in on_host)
        inner: torch.optim.Optimizer = (
            HybridAdam(wrapped.parameters(), lr=ADAM_LR, weight_decay=0.01)
            if world == 1
            else torch.optim.SGD(wrapped.parameters(), lr=SGD_LR, momentum=0.9)
        )
        opt: torch.optim.Optimizer = GeminiOptimizer(inner, wrapped)
    else:
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy({_Block}),
            offload_params=True,
            device="cuda",
            forward_prefetch=prefetch,
        )
        opt = (
            torch.optim.AdamW(wrapped.parameters(), lr=ADAM_LR)
            if world == 1
            else torch.optim.SGD(wrapped.parameters(), lr=SGD_LR, momentum=0.9)
        )
    shard = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        lo, hi = rank * shard, (rank + 1) * shard
        loss = nn.functional.cross_entropy(wrapped(x[lo:hi]), y[lo:hi])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        if kind == "gemini-step-in-backward":  # no gradient memory kept between steps
            assert all(c.held_grad is None for c in wrapped.chunks)
    full = wrapped.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(
            full[name].to(value.device), value, rtol=1e-5, atol=1e-6, msg=name
        )
    torch.cuda.synchronize()


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_zero3_matches_single_process_on_cuda(world_size: int) -> None:
    run_subtests(
        check_offloaded_zero3_on_cuda,
        world_size,
        {"kind": ["gemini", "gemini-step-in-backward", "fsdp"], "prefetch": [True, False]},
        timeout=280,
    )


def _offloaded(kind: str, device: str, dtype: torch.dtype, in_backward: bool) -> ShardedModule:
    model = _model()
    if kind == "gemini":
        return GeminiDDP(
            model,
            device=device,
            offload_param_frac=0.5,
            chunk_size=chunk_size_for(model, 6),
            mixed_precision=dtype,
            step_in_backward=in_backward,
        )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=transformer_auto_wrap_policy({_Block}),
        offload_params=True,
        device=device,
        mixed_precision=MixedPrecision(param_dtype=dtype) if dtype != torch.float32 else None,
        step_in_backward=in_backward,
    )


def check_in_backward_matches_after_backward(kind: str, dtype: torch.dtype, device: str) -> None:
    """Stepping in backward against stepping after backward, same settings
    (half the chunks on the host, bf16 or fp32 compute, HybridAdam): the
    same element-wise update, so the same losses and parameters. Each
    reduction first queues a ~30 ms spin on the GPU, so a host step that
    read a gradient before its copy landed, or a gather that read a shard
    before its update, shows as a difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    original = Chunk.reduce_scatter_grads

    def delayed(self: Chunk, *args: object, **kwargs: object) -> torch.Tensor | None:
        if device == "cuda":
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    Chunk.reduce_scatter_grads = delayed  # type: ignore[method-assign]
    try:
        runs = []
        for in_backward in (False, True):
            wrapped = _offloaded(kind, device, dtype, in_backward)
            opt = GeminiOptimizer(
                HybridAdam(wrapped.parameters(), lr=ADAM_LR, weight_decay=0.01), wrapped
            )
            losses = []
            shard = GLOBAL_BATCH // world
            for step in range(STEPS):
                x, y = _batch(step, device)
                lo, hi = rank * shard, (rank + 1) * shard
                loss = nn.functional.cross_entropy(wrapped(x[lo:hi]).float(), y[lo:hi])
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().clone())
            if in_backward:
                assert all(c.held_grad is None for c in wrapped.manager.chunks)
            runs.append((torch.stack(losses), wrapped.full_state_dict()))
    finally:
        Chunk.reduce_scatter_grads = original  # type: ignore[method-assign]
    (after_losses, after_state), (in_losses, in_state) = runs
    torch.testing.assert_close(in_losses, after_losses, rtol=1e-5, atol=1e-6)
    for name, value in after_state.items():
        torch.testing.assert_close(in_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_in_backward_matches_step_after_backward_on_cuda(world_size: int) -> None:
    run_subtests(
        check_in_backward_matches_after_backward,
        world_size,
        {"kind": ["gemini", "fsdp"], "dtype": [torch.float32, torch.bfloat16], "device": ["cuda"]},
        timeout=280,
    )
