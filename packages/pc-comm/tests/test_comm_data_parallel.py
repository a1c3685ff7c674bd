"""Data parallelism from the pieces of this package: each rank runs its
slice of the global batch and averages gradients with all_reduce_coalesced.
Losses and parameters must match single-process training on the global
batch, step after step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm import ReduceOp, TorchCommunicator, all_reduce_coalesced
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(180)

STEPS, GLOBAL_BATCH = 5, 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 12, generator=gen), torch.randint(
        0, 5, (GLOBAL_BATCH,), generator=gen
    )


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def check_parity(optimizer_name: str, async_op: bool) -> None:
    comm = TorchCommunicator()
    rank, world = comm.rank, comm.world_size
    shard = GLOBAL_BATCH // world
    reference, model = _model(), _model()
    ref_opt, opt = _optimizer(reference, optimizer_name), _optimizer(model, optimizer_name)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()

        opt.zero_grad()
        local = loss_fn(
            model(x[rank * shard : (rank + 1) * shard]), y[rank * shard : (rank + 1) * shard]
        )
        local.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_coalesced(comm, grads, ReduceOp.AVG, async_op=async_op).wait()
        opt.step()
        loss = local.detach().clone()
        comm.all_reduce(loss, ReduceOp.AVG)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # The ranks stayed replicas of one another, bit for bit.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.empty(world * flat.numel())
    comm.all_gather(gathered, flat)
    assert all(torch.equal(chunk, flat) for chunk in gathered.view(world, -1))
    assert dist.get_world_size() == world


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_averaging_matches_single_process(world_size: int) -> None:
    run_subtests(
        check_parity, world_size, {"optimizer_name": ["sgd", "adamw"], "async_op": [False, True]}
    )
