"""A training step driven by the ChunkManager's hooks, with a device budget
below the model's size: device residency stays under the budget at every
moment (every reservation is checked, and the log is replayed), and the
model trains exactly as plain single-process training, at 1 and 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_chunk import (
    AutoPlacement,
    BudgetExceededError,
    Chunk,
    ChunkManager,
    DeviceBudget,
    StaticPlacement,
    execution_order,
)
from pc_comm import TorchCommunicator
from pc_comm.testing import run_subtests
from pc_offload import CopyEngine, PinnedPool

pytestmark = pytest.mark.timeout(180)

GLOBAL_BATCH, STEPS, LR = 8, 4, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(8)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 32, generator=torch.Generator().manual_seed(step))


def check_step_under_budget(placement: str, world: int) -> None:
    comm = TorchCommunicator() if world > 1 else None
    rank = comm.rank if comm is not None else 0
    model, reference = _model(), _model()
    size = sum(p.numel() * 4 for p in model.parameters())
    # Below the model's size: half of it, or three quarters with 2 ranks,
    # whose chunks (and so the working set of one gathered chunk) are twice as big.
    budget = DeviceBudget(limit_bytes=size // 2 if world == 1 else size * 3 // 4, record=True)
    policy = StaticPlacement(0.125) if placement == "static" else AutoPlacement()
    # Host shards are long-lived buffers of their own, not the pool's: a
    # pool with room for one 8 KiB buffer suffices [Note: host buffers].
    engine = CopyEngine(PinnedPool(8192))
    manager = ChunkManager(
        model,
        example_inputs=(_batch(0),),
        chunk_size=1088 if world == 1 else 1088 * 2,
        comm=comm,
        budget=budget,
        placement=policy,
        engine=engine,
    )
    on_host = [c for c in manager.chunks if not c.shard_on_device]
    assert on_host, "the budget forces some shards to the host"
    assert len(on_host) > 1
    for chunk in on_host:
        assert chunk.shard is not None
        assert chunk.shard.device.type == "cpu"
        assert not engine.pool.owns(chunk.shard)
        assert chunk.shard.numel() == chunk.shard_size
    manager.attach()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    shard = GLOBAL_BATCH // world
    grad_buffers: dict[str, set[int]] = {}

    def update(chunk: Chunk, grad: torch.Tensor) -> torch.Tensor:
        grad_buffers.setdefault(chunk.name, set()).add(grad.data_ptr())
        assert chunk.shard is not None
        return chunk.shard.float() - LR * grad

    for step in range(STEPS):
        x = _batch(step)
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(x[rank * shard : (rank + 1) * shard]).square().mean()
        loss.backward()
        assert all(c.state.value == "free" for c in manager.chunks)
        manager.step(update)
    # The limit held at every moment: replay the log of every reservation.
    assert budget.peak_bytes <= budget.limit_bytes
    assert max(used for _, _, used in budget.log) == budget.peak_bytes
    assert budget.peak_bytes > 0
    # Every step copied each host chunk's gradient shard into the same
    # buffer, and no pool buffer is left in use.
    assert all(len(grad_buffers[c.name]) == 1 for c in on_host), grad_buffers
    assert engine.pool.stats().in_use_bytes == 0
    manager.detach()
    budget.limit_bytes = 10**9  # to compare, gather everything
    for chunk in manager.chunks:
        chunk.gather()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("placement", ["static", "auto"])
def test_single_rank_step_stays_under_budget(placement: str) -> None:
    check_step_under_budget(placement, 1)


def test_two_rank_steps_stay_under_budget() -> None:
    run_subtests(check_step_under_budget, 2, {"placement": ["static", "auto"], "world": [2]})


def test_too_small_a_budget_is_refused_with_the_numbers() -> None:
    model = _model()
    budget = DeviceBudget(limit_bytes=1000)
    with pytest.raises(BudgetExceededError, match=r"chunk0 payload needs 4352 bytes"):
        ChunkManager(model, chunk_size=1088, budget=budget)


def test_execution_order_follows_first_use() -> None:
    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.a(self.b(x))  # b runs first
            return out

    model = Backwards()
    order = execution_order(model, torch.randn(2, 4))
    assert order == [model.b.weight, model.b.bias, model.a.weight, model.a.bias]
    assert execution_order(model) == list(model.parameters())  # no inputs: module order
