"""The staged CUDA path of the host communicators: CUDA tensors go to pinned
host memory on a side stream, are reduced in shared memory and come back.
Two ranks share the one GPU a lent machine has (gloo carries only the
setup). Runs with `nox -s gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm import (
    Communicator,
    DistributedDataParallel,
    HierarchicalCommunicator,
    ReduceOp,
    ShmCommunicator,
)
from pc_comm.testing import run_subtests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_COMMS: dict[str, Communicator] = {}


def _comm(kind: str) -> Communicator:
    if kind not in _COMMS:
        torch.cuda.set_device(0)
        # Small slots: large tensors cross the segment in several pieces.
        _COMMS[kind] = (
            ShmCommunicator(slot_bytes=64 * 1024)
            if kind == "shm"
            else HierarchicalCommunicator(local_size=dist.get_world_size(), slot_bytes=64 * 1024)
        )
    return _COMMS[kind]


def _value(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent small integers: exact in bf16 sums, any order."""
    return ((torch.arange(numel) % 7) + rank + 1).to(dtype)


def check_collectives(kind: str, dtype: torch.dtype, numel: int, async_op: bool) -> None:
    comm = _comm(kind)
    rank, world = comm.rank, comm.world_size
    device = torch.device("cuda", 0)
    values = [_value(r, numel, dtype) for r in range(world)]
    total = torch.stack([v.float() for v in values]).sum(0)

    x = values[rank].to(device).clone()
    # Work queued on the current stream before the call must be seen by it.
    x.mul_(2)
    comm.all_reduce(x, ReduceOp.SUM, async_op=async_op).wait()
    torch.testing.assert_close(x.cpu().float(), 2 * total, rtol=0, atol=0)

    x = values[rank].to(device).clone()
    comm.all_reduce(x, ReduceOp.AVG, async_op=async_op).wait()
    torch.testing.assert_close(x.cpu(), (total / world).to(dtype), rtol=0, atol=0)

    x = values[rank].to(device).clone()
    comm.broadcast(x, src=world - 1, async_op=async_op).wait()
    torch.testing.assert_close(x.cpu(), values[world - 1], rtol=0, atol=0)

    full = torch.cat([_value(r, numel, dtype) for r in range(world)])
    out = torch.empty(numel * world, dtype=dtype, device=device)
    comm.all_gather(out, values[rank].to(device).clone(), async_op=async_op).wait()
    torch.testing.assert_close(out.cpu(), full, rtol=0, atol=0)

    pieces = [torch.cat([_value(r + i, numel, dtype) for i in range(world)]) for r in range(world)]
    mine = torch.empty(numel, dtype=dtype, device=device)
    comm.reduce_scatter(
        mine, pieces[rank].to(device).clone(), ReduceOp.SUM, async_op=async_op
    ).wait()
    expected = torch.stack([p.float() for p in pieces]).sum(0).view(world, numel)[rank]
    torch.testing.assert_close(mine.cpu().float(), expected, rtol=0, atol=0)

    # Uneven list variants.
    outs = [torch.empty(r + 3, dtype=dtype, device=device) for r in range(world)]
    comm.all_gather_list(
        outs, _value(rank, rank + 3, dtype).to(device).clone(), async_op=async_op
    ).wait()
    for r, o in enumerate(outs):
        torch.testing.assert_close(o.cpu(), _value(r, r + 3, dtype), rtol=0, atol=0)
    inputs = [_value(rank, r + 3, dtype).to(device).clone() for r in range(world)]
    mine = torch.empty(rank + 3, dtype=dtype, device=device)
    comm.reduce_scatter_list(mine, inputs, ReduceOp.SUM, async_op=async_op).wait()
    expected = torch.stack([_value(r, rank + 3, dtype).float() for r in range(world)]).sum(0)
    torch.testing.assert_close(mine.cpu().float(), expected, rtol=0, atol=0)
    torch.cuda.synchronize()


def test_staged_collectives_on_cuda_tensors() -> None:
    run_subtests(
        check_collectives,
        2,
        {
            "kind": ["shm", "hierarchical"],
            "dtype": [torch.float32, torch.bfloat16],
            "numel": [1, 1000, (1 << 20) + 3, 16 << 20],
            "async_op": [False, True],
        },
        timeout=280,
    )


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 10)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x))
        return out


def check_ddp_on_cuda(kind: str, bucket_cap_mb: float, accumulate: int) -> None:
    """DDP over a host communicator with the model on the GPU matches one
    process training on the whole batch."""
    comm = _comm(kind)
    rank, world = comm.rank, comm.world_size
    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = _Net().to(device)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        _Net().to(device),
        communicator=comm,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=True,
    )
    # SGD: Adam's first step is about sign(grad), which turns rounding noise
    # in near-zero gradients (GELU tails) into full steps.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    batch, shard = 16, 16 // world
    for step in range(5):
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_total = torch.zeros((), device=device)
        total = torch.zeros((), device=device)
        for micro in range(accumulate):
            gen = torch.Generator().manual_seed(100 * step + micro)
            x = torch.randn(batch, 64, generator=gen).to(device)
            y = torch.randint(0, 10, (batch,), generator=gen).to(device).clone()
            ref_loss = nn.functional.cross_entropy(reference(x), y) / accumulate
            ref_loss.backward()  # type: ignore[no-untyped-call]
            ref_total += ref_loss.detach()
            lo, hi = rank * shard, (rank + 1) * shard
            loss = nn.functional.cross_entropy(ddp(x[lo:hi]), y[lo:hi]) / accumulate
            if micro < accumulate - 1:
                with ddp.no_sync():
                    loss.backward()  # type: ignore[no-untyped-call]
            else:
                loss.backward()  # type: ignore[no-untyped-call]
            total += loss.detach()
        ref_opt.step()
        opt.step()
        comm.all_reduce(total, ReduceOp.AVG)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")


def test_ddp_with_a_host_communicator_on_cuda() -> None:
    run_subtests(
        check_ddp_on_cuda,
        2,
        {"kind": ["shm", "hierarchical"], "bucket_cap_mb": [0.01, 25.0], "accumulate": [1, 2]},
        timeout=280,
    )
