"""Every TorchCommunicator operation against the single-process result.

Each rank can compute every rank's input (they are seeded by rank), so the
reference is computed locally on each rank by reducing or concatenating the
inputs of all ranks, exactly as one process would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from pc_comm import (
    Communicator,
    HierarchicalCommunicator,
    P2PKind,
    P2POp,
    ReduceOp,
    ShmCommunicator,
    TorchCommunicator,
    all_reduce_coalesced,
)
from pc_comm.testing import run_subtests, spawn

pytestmark = pytest.mark.timeout(300)

DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SIZES = [1, 7, 1031]
REDUCTIONS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN]


def rank_input(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """What rank ``rank`` contributes. bf16 and int64 hold small integers, so
    every sum and average of them is exact and compared exactly; fp32 holds
    normal samples and is compared at fp32 tolerance."""
    gen = torch.Generator().manual_seed(1000 * rank + 7 * numel + salt)
    if dtype == torch.float32:
        return torch.randn(numel, generator=gen)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)


def reference_reduce(stacked: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    world = stacked.shape[0]
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.AVG:
        total = stacked.sum(0)
        if stacked.dtype.is_floating_point:
            return total / world
        return torch.div(total, world, rounding_mode="trunc")
    if op is ReduceOp.MAX:
        return stacked.max(0).values
    assert op is ReduceOp.MIN
    return stacked.min(0).values


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(actual, expected), f"{actual} != {expected}"


def _all_inputs(world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([rank_input(r, numel, dtype) for r in range(world)])


_COMMS: dict[str, Communicator] = {}


def make_comm(backend: str) -> Communicator:
    """One communicator of each kind per process, reused by every sub-case.
    The shared-memory ones get small slots so that sizes above 4 KiB are
    moved in several pieces. "hier" simulates nodes: 2 ranks per node at
    world 4 (2 nodes x 2), one node of 2 at world 2, three nodes of 1 at
    world 3; "hier_env" finds the nodes from torchrun's environment."""
    if backend not in _COMMS:
        world = dist.get_world_size()
        if backend == "torch":
            _COMMS[backend] = TorchCommunicator()
        elif backend == "shm_default":
            _COMMS[backend] = ShmCommunicator()
        elif backend == "hier":
            local = {2: 2, 3: 1}.get(world, 2)
            _COMMS[backend] = HierarchicalCommunicator(local_size=local, slot_bytes=4096)
        elif backend == "hier_default":
            _COMMS[backend] = HierarchicalCommunicator(local_size=2)
        elif backend == "hier_env":
            _COMMS[backend] = HierarchicalCommunicator(slot_bytes=4096)
        else:
            _COMMS[backend] = ShmCommunicator(slot_bytes=4096)
    return _COMMS[backend]


@dataclass(frozen=True)
class _Case:
    """One sub-case of :func:`check_collective` on this rank."""

    comm: Communicator
    rank: int
    world: int
    dtype: torch.dtype
    size: int
    async_op: bool

    def input(self, rank: int, numel: int | None = None, salt: int = 0) -> torch.Tensor:
        return rank_input(rank, self.size if numel is None else numel, self.dtype, salt=salt)


def _check_all_reduce(c: _Case) -> None:
    for op in REDUCTIONS:
        tensor = c.input(c.rank)
        c.comm.all_reduce(tensor, op, async_op=c.async_op).wait()
        assert_matches(tensor, reference_reduce(_all_inputs(c.world, c.size, c.dtype), op))


def _check_reduce_scatter(c: _Case) -> None:
    size, rank = c.size, c.rank
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        full = c.input(rank, c.world * size)
        out = torch.empty(size, dtype=c.dtype)
        c.comm.reduce_scatter(out, full, op, async_op=c.async_op).wait()
        everyone = _all_inputs(c.world, c.world * size, c.dtype)
        expected = reference_reduce(everyone, op)[rank * size : (rank + 1) * size]
        assert_matches(out, expected)


def _check_reduce_scatter_list(c: _Case) -> None:
    # Uneven: slot i has size + i elements.
    size, rank = c.size, c.rank
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        slots = [c.input(rank, size + i, salt=i) for i in range(c.world)]
        out = torch.empty(size + rank, dtype=c.dtype)
        c.comm.reduce_scatter_list(out, slots, op, async_op=c.async_op).wait()
        mine = torch.stack([c.input(r, size + rank, salt=rank) for r in range(c.world)])
        assert_matches(out, reference_reduce(mine, op))


def _check_all_gather(c: _Case) -> None:
    out = torch.empty(c.world * c.size, dtype=c.dtype)
    c.comm.all_gather(out, c.input(c.rank), async_op=c.async_op).wait()
    assert_matches(out, _all_inputs(c.world, c.size, c.dtype).reshape(-1))


def _check_all_gather_list(c: _Case) -> None:
    # Uneven: rank r contributes size + r elements.
    outs = [torch.empty(c.size + r, dtype=c.dtype) for r in range(c.world)]
    c.comm.all_gather_list(outs, c.input(c.rank, c.size + c.rank), async_op=c.async_op).wait()
    for r, out in enumerate(outs):
        assert_matches(out, c.input(r, c.size + r))


def _check_broadcast(c: _Case) -> None:
    src = c.world - 1
    tensor = c.input(c.rank)
    c.comm.broadcast(tensor, src, async_op=c.async_op).wait()
    assert_matches(tensor, c.input(src))


def _check_send_recv(c: _Case) -> None:
    # A ring through batch_p2p, then a plain pair between ranks 0 and 1.
    rank, world = c.rank, c.world
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(c.size, dtype=c.dtype)
    handles = c.comm.batch_p2p(
        [
            P2POp(P2PKind.SEND, c.input(rank), nxt),
            P2POp(P2PKind.RECV, got, prev),
        ]
    )
    for handle in handles:
        handle.wait()
    assert_matches(got, c.input(prev))
    if rank == 0:
        c.comm.send(c.input(0, salt=5), 1, async_op=c.async_op).wait()
    elif rank == 1:
        got = torch.empty(c.size, dtype=c.dtype)
        c.comm.recv(got, 0, async_op=c.async_op).wait()
        assert_matches(got, c.input(0, salt=5))


def _check_coalesced(c: _Case) -> None:
    size, world = c.size, c.world
    tensors = [c.input(c.rank, size + i, salt=i) for i in range(3)]
    tensors.append(rank_input(c.rank, size, torch.float32, salt=9))  # a second dtype
    handle = all_reduce_coalesced(c.comm, tensors, ReduceOp.AVG, async_op=c.async_op)
    handle.wait()
    assert handle.is_completed()
    for i, tensor in enumerate(tensors[:3]):
        everyone = torch.stack([c.input(r, size + i, salt=i) for r in range(world)])
        assert_matches(tensor, reference_reduce(everyone, ReduceOp.AVG))
    everyone = torch.stack([rank_input(r, size, torch.float32, salt=9) for r in range(world)])
    assert_matches(tensors[3], reference_reduce(everyone, ReduceOp.AVG))


_CHECKS: dict[str, Callable[[_Case], None]] = {
    "all_reduce": _check_all_reduce,
    "reduce_scatter": _check_reduce_scatter,
    "reduce_scatter_list": _check_reduce_scatter_list,
    "all_gather": _check_all_gather,
    "all_gather_list": _check_all_gather_list,
    "broadcast": _check_broadcast,
    "send_recv": _check_send_recv,
    "coalesced": _check_coalesced,
}


def check_collective(
    kind: str, dtype: torch.dtype, size: int, async_op: bool, backend: str = "torch"
) -> None:
    comm = make_comm(backend)
    rank, world = comm.rank, comm.world_size
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    if kind not in _CHECKS:
        raise AssertionError(f"unknown kind {kind}")
    # Point-to-point is checked where the communicator has it (torch, hier).
    if kind != "send_recv" or backend.startswith(("torch", "hier")):
        _CHECKS[kind](_Case(comm, rank, world, dtype, size, async_op))
    comm.barrier()


KINDS = [
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_list",
    "all_gather",
    "all_gather_list",
    "broadcast",
    "send_recv",
    "coalesced",
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_single_process(world_size: int) -> None:
    run_subtests(
        check_collective,
        world_size,
        {
            "backend": ["torch", "shm", "hier"],
            "kind": KINDS,
            "dtype": DTYPES,
            "size": SIZES,
            "async_op": [False, True],
        },
        timeout=240,
    )


def check_large(kind: str, dtype: torch.dtype, backend: str = "shm_default") -> None:
    """64 MB messages through the shared-memory communicator's default slots
    (16 MiB), or the hierarchical one, against the same operation through
    torch.distributed."""
    shm, ref = make_comm(backend), make_comm("torch")
    numel = 64 * 1024 * 1024 // dtype.itemsize
    numel -= numel % shm.world_size
    data = rank_input(shm.rank, numel, dtype)
    ours, theirs = data.clone(), data.clone()
    if kind == "all_reduce":
        shm.all_reduce(ours, ReduceOp.AVG)
        ref.all_reduce(theirs, ReduceOp.AVG)
        assert_matches(ours, theirs)
    elif kind == "reduce_scatter":
        out_ours = torch.empty(numel // shm.world_size, dtype=dtype)
        out_ref = torch.empty_like(out_ours)
        shm.reduce_scatter(out_ours, data, ReduceOp.SUM)
        ref.reduce_scatter(out_ref, data, ReduceOp.SUM)
        assert_matches(out_ours, out_ref)
    else:
        part = data[: numel // shm.world_size]
        gathered_ours = torch.empty(numel, dtype=dtype)
        gathered_ref = torch.empty_like(gathered_ours)
        shm.all_gather(gathered_ours, part)
        ref.all_gather(gathered_ref, part)
        assert torch.equal(gathered_ours, gathered_ref)


@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_and_hierarchical_64mb_match_torch(world_size: int) -> None:
    run_subtests(
        check_large,
        world_size,
        {
            "kind": ["all_reduce", "reduce_scatter", "all_gather"],
            "dtype": DTYPES[:2],
            "backend": ["shm_default", "hier_default"],
        },
        timeout=240,
    )


def check_bad_input() -> None:
    comm = TorchCommunicator()
    with pytest.raises(ValueError, match=r"expected world_size \(2\) \* output \(3\) = 6"):
        comm.reduce_scatter(torch.empty(3), torch.empty(7))
    with pytest.raises(ValueError, match=r"expected world_size \(2\) \* input \(3\) = 6"):
        comm.all_gather(torch.empty(5), torch.empty(3))
    with pytest.raises(ValueError, match="share dtype and device"):
        comm.all_gather(torch.empty(6), torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="one tensor per rank"):
        comm.all_gather_list([torch.empty(1)], torch.empty(1))
    with pytest.raises(ValueError, match="this rank's slot"):
        comm.reduce_scatter_list(torch.empty(2), [torch.empty(5), torch.empty(5)])
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.empty(4, 4).t())
    with pytest.raises(ValueError, match=r"in \[0, 2\), got 5"):
        comm.broadcast(torch.empty(1), 5)
    with pytest.raises(ValueError, match="cannot message itself"):
        comm.send(torch.empty(1), comm.rank)
    with pytest.raises(TypeError, match=r"pc_comm\.ReduceOp"):
        comm.all_reduce(torch.empty(1), "sum")  # type: ignore[arg-type]
    comm.barrier()  # nothing above reached the wire: the group is still in step


def check_subgroup_communicator() -> None:
    # A communicator over a subgroup uses group-local ranks for src/dst.
    world = dist.get_world_size()
    odd = dist.new_group([r for r in range(world) if r % 2 == 1])
    even = dist.new_group([r for r in range(world) if r % 2 == 0])
    rank = dist.get_rank()
    comm = TorchCommunicator(odd if rank % 2 else even)
    assert comm.world_size == world // 2
    assert comm.rank == rank // 2
    tensor = torch.tensor([float(rank)])
    comm.broadcast(tensor, src=comm.world_size - 1)
    members = [r for r in range(world) if r % 2 == rank % 2]
    assert tensor.item() == float(members[-1])
    comm.all_reduce(tensor)
    assert tensor.item() == float(members[-1] * len(members))


def test_bad_input_is_rejected_with_a_clear_message() -> None:
    spawn(check_bad_input, 2, timeout=60)


def test_subgroup_ranks_are_group_local() -> None:
    spawn(check_subgroup_communicator, 4, timeout=60)
