"""Shared-memory send/recv give torch's point-to-point results: every size
from one element to several ring-fulls, fp32 and bf16, FIFO order between a
pair, batches in both directions at once, and a timeout for a missing peer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pc_comm import P2PKind, P2POp, ShmCommunicator
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(240)

# 1 element, odd sizes, exactly one piece (1 MiB of fp32), and more pieces
# than the ring holds (4 x 1 MiB), so the sender waits for the receiver.
NUMELS = [1, 7, 1000, 262144, 262145, 3_000_001]


def _payload(rank: int, numel: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + tag)
    return torch.randn(numel, generator=g).to(dtype)


def check_ring_exchange(dtype: torch.dtype) -> None:
    """Each rank sends several messages to its right neighbour and receives
    from its left one, all posted at once in one batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = ShmCommunicator()
    right, left = (rank + 1) % world, (rank - 1) % world
    outs = [_payload(rank, n, dtype, k) for k, n in enumerate(NUMELS)]
    ins = [torch.empty(n, dtype=dtype) for n in NUMELS]
    ops = [P2POp(P2PKind.SEND, t, right) for t in outs]
    ops += [P2POp(P2PKind.RECV, t, left) for t in ins]
    handles = comm.batch_p2p(ops)
    for handle in handles:
        handle.wait(timeout=60)
        assert handle.is_completed()
    for k, (got, n) in enumerate(zip(ins, NUMELS, strict=True)):
        want = _payload(left, n, dtype, k)
        assert torch.equal(got, want), (k, n)
    # Blocking calls, and a reply in the other direction.
    if rank == 0:
        comm.send(outs[2], 1)
        back = torch.empty_like(outs[2])
        comm.recv(back, 1)
        assert torch.equal(back, outs[2] * 2)
    elif rank == 1:
        got = torch.empty_like(outs[2])
        comm.recv(got, 0)
        comm.send(got * 2, 0)
    comm.close()


def check_timeout_and_bad_peer() -> None:
    rank = dist.get_rank()
    comm = ShmCommunicator()
    with pytest.raises(ValueError, match=r"another rank"):
        comm.send(torch.ones(2), rank)
    if rank == 0:
        handle = comm.recv(torch.empty(4), 1, async_op=True)  # rank 1 never sends
        with pytest.raises(
            TimeoutError,
            match=r"recv of 16 bytes with rank 1 did not complete \(not completed within 0.5 s\)",
        ):
            handle.wait(timeout=0.5)
    dist.barrier()
    comm.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_send_recv_match_torch(world_size: int) -> None:
    run_subtests(check_ring_exchange, world_size, {"dtype": [torch.float32, torch.bfloat16]})


def test_shm_p2p_timeout_and_errors() -> None:
    run_subtests(check_timeout_and_bad_peer, 2, {})
