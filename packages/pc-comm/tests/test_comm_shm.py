"""ShmCommunicator's failure modes and segment hygiene: a dead or stuck peer
is an error on the survivors within the timeout, and /dev/shm stays clean
after a normal exit, an exception or a SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pc_comm import ReduceOp, ShmCommunicator, ShmPeerError, health
from pc_comm.testing import DistributedTestError, spawn

pytestmark = pytest.mark.timeout(180)

SHM = Path("/dev/shm")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("pc-comm-*")} if SHM.is_dir() else set()


def _names_gone_after_setup() -> None:
    comm = ShmCommunicator(slot_bytes=4096)
    # The name is unlinked once every rank has mapped it.
    assert not _segments(), _segments()
    t = torch.ones(10_000)
    comm.all_reduce(t, ReduceOp.SUM)
    assert torch.all(t == comm.world_size)
    if dist.get_rank() == 1:
        raise RuntimeError("planned failure after a collective")


def test_no_segment_left_after_exception() -> None:
    before = _segments()
    with pytest.raises(DistributedTestError, match="planned failure"):
        spawn(_names_gone_after_setup, 2, timeout=60)
    assert _segments() == before


def _set_up_a_communicator() -> None:
    ShmCommunicator(slot_bytes=4096)


def test_a_crashed_setups_segment_is_removed_at_the_next_start() -> None:
    """A rank killed between creating a segment and unlinking its name
    leaves the name; it carries the creator's pid, and the next segment
    made on the host removes names whose creator is gone
    ([Note: segment lifetime] in pc_comm.shm); a live creator's stays."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    stale = SHM / f"pc-comm-{gone.pid}-{'0' * 32}"
    live = SHM / f"pc-comm-{os.getpid()}-{'1' * 32}"
    for path in (stale, live):
        path.write_bytes(b"\0" * 4096)
    try:
        spawn(_set_up_a_communicator, 2, timeout=60)
        assert not stale.exists()
        assert live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def _killed_mid_collective() -> None:
    health.start_board(interval=0.2)
    comm = ShmCommunicator(slot_bytes=4096, timeout=timedelta(seconds=30))
    # 64 MB through 4 KiB slots: 16,384 pieces, far longer than the 50 ms
    # before rank 1 dies (1M elements once finished first under a futex barrier).
    big = torch.ones(16_000_000)
    if dist.get_rank() == 1:
        # Join the first pieces of the collective, then die inside it.
        def die() -> None:
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        import threading

        threading.Thread(target=die, daemon=True).start()
    comm.all_reduce(big)
    time.sleep(5)  # rank 1 is dead by now; rank 0 never gets here


def test_rank_killed_mid_collective_is_named_and_leaves_nothing() -> None:
    before = _segments()
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        spawn(_killed_mid_collective, 2, timeout=60)
    message = str(info.value)
    assert "rank 1: was killed by signal SIGKILL" in message
    assert (
        "ShmPeerError: rank 0 failed: shared-memory all_reduce did not complete (rank 1 (pid"
        in message
    )
    assert "died while rank 0 waited for it)" in message
    # The health board adds where rank 1 was.
    assert "rank 1: its process is gone (no phase declared; " in message
    assert time.monotonic() - start < 30
    assert _segments() == before


def _stuck_peer() -> None:
    comm = ShmCommunicator(timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(3600)
    comm.all_reduce(torch.ones(4))


def test_stuck_peer_times_out_with_a_clear_error() -> None:
    with pytest.raises(DistributedTestError) as info:
        spawn(_stuck_peer, 2, timeout=20)
    message = str(info.value)
    assert (
        "ShmPeerError: rank 0 failed: shared-memory all_reduce did not complete (rank(s) [1] did "
        "not reach it within 2 s)" in message
    )


def _async_overlap_and_order() -> None:
    comm = ShmCommunicator(slot_bytes=4096)
    tensors = [torch.full((5000,), float(i + dist.get_rank())) for i in range(6)]
    handles = [comm.all_reduce(t, ReduceOp.AVG, async_op=True) for t in tensors]
    for handle in reversed(handles):
        handle.wait()
    for i, t in enumerate(tensors):
        assert torch.all(t == i + 0.5), (i, t[:3])
    comm.barrier()
    comm.close()


def test_async_operations_run_in_call_order() -> None:
    spawn(_async_overlap_and_order, 2, timeout=60)


def _bad_input() -> None:
    with pytest.raises(ValueError, match="slot_bytes must be a multiple of 64"):
        ShmCommunicator(slot_bytes=1000)
    comm = ShmCommunicator()
    with pytest.raises(TypeError, match=r"pc_comm\.ReduceOp"):
        comm.all_reduce(torch.ones(2), "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be contiguous"):
        comm.all_reduce(torch.ones(3, 3).t())
    with pytest.raises(ValueError, match=r"peer must be another rank"):
        comm.send(torch.ones(1), comm.rank)
    comm.barrier()


def test_bad_input_is_rejected() -> None:
    spawn(_bad_input, 2, timeout=60)


def _mismatched_calls() -> None:
    comm = ShmCommunicator(timeout=timedelta(seconds=20))
    rank = dist.get_rank()

    def mismatch() -> None:
        if rank == 0:
            comm.all_reduce(torch.ones(10), ReduceOp.SUM)
        else:
            comm.all_gather(torch.empty(20), torch.ones(10))

    # Repeated back to back: a rank that raised goes straight on to its next
    # call, which must not overwrite the signature a slower peer still reads.
    for _ in range(20):
        with pytest.raises(ShmPeerError) as info:
            mismatch()
        message = str(info.value)
        assert "rank 0: all_reduce(count=10, dtype=float32, op=sum)" in message, message
        assert "rank 1: all_gather(count=10, dtype=float32)" in message, message
        with pytest.raises(ShmPeerError, match=r"count=7.*count=8"):
            comm.broadcast(torch.ones(7 + rank), src=0)
    comm.all_reduce(torch.ones(3))


def test_mismatched_collectives_are_named() -> None:
    spawn(_mismatched_calls, 2, timeout=60)


def _symmetric_buffers() -> None:
    """All-reduce of tensors from ``alloc`` (zero-copy path) against the
    single-process result, whole buffers and sub-slices, at world 3."""
    comm = ShmCommunicator(slot_bytes=4096)
    rank, world = comm.rank, comm.world_size
    for numel, dtype, op in [
        (1, torch.float32, ReduceOp.SUM),
        (1031, torch.float32, ReduceOp.AVG),
        (100_003, torch.float32, ReduceOp.MAX),
        (1031, torch.bfloat16, ReduceOp.SUM),
        (1031, torch.int64, ReduceOp.AVG),
        (517, torch.float64, ReduceOp.MIN),
        # Slices of several 256 KiB blocks, the last one partial.
        (300_007, torch.float32, ReduceOp.AVG),
        (400_009, torch.bfloat16, ReduceOp.SUM),
    ]:
        buffer = comm.alloc(numel + 10, dtype)
        assert torch.all(buffer == 0)
        inputs = [
            torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(r)).to(dtype)
            for r in range(world)
        ]
        view = buffer[5 : 5 + numel]  # a slice: the same offset on every rank
        view.copy_(inputs[rank])
        comm.all_reduce(view, op)
        stacked = torch.stack(inputs)
        if op is ReduceOp.SUM:
            expected = stacked.sum(0)
        elif op is ReduceOp.AVG:
            total = stacked.sum(0)
            expected = (
                total / world
                if dtype.is_floating_point
                else torch.div(total, world, rounding_mode="trunc")
            )
        elif op is ReduceOp.MAX:
            expected = stacked.max(0).values
        else:
            expected = stacked.min(0).values
        torch.testing.assert_close(view, expected.to(dtype), rtol=1e-6, atol=0)
        assert torch.all(buffer[:5] == 0)
        assert torch.all(buffer[5 + numel :] == 0)
    assert len(comm._symmetric) == 2  # the last two; earlier ones died and were pruned
    del buffer, view
    comm.alloc(8)  # dead buffers are forgotten
    assert len(comm._symmetric) == 1
    with pytest.raises(ValueError, match="same numel and dtype on every rank"):
        comm.alloc(8 + rank)
    _symmetric_scatter_gather(comm)


def _symmetric_scatter_gather(comm: ShmCommunicator) -> None:
    """Reduce-scatter from, and all-gather into, a symmetric buffer (the
    zero-copy paths), in place and not, against the single-process result."""
    rank, world = comm.rank, comm.world_size
    calls: list[str] = []
    for name in ("_symmetric_reduce_scatter", "_symmetric_all_gather"):
        original = getattr(comm, name)

        def counted(*args: object, _f: object = original, _n: str = name) -> None:
            calls.append(_n)
            _f(*args)  # type: ignore[operator]

        setattr(comm, name, counted)
    for size, dtype, op in [(1, torch.float32, ReduceOp.SUM), (1031, torch.bfloat16, ReduceOp.AVG)]:
        buffer = comm.alloc(world * size + 6, dtype)
        flat = buffer[3 : 3 + world * size]
        inputs = [
            torch.randint(-8, 9, (world * size,), generator=torch.Generator().manual_seed(r)).to(
                dtype
            )
            for r in range(world)
        ]
        total = torch.stack(inputs).float().sum(0)
        expected = (total / world if op is ReduceOp.AVG else total).view(world, size)[rank]
        for in_place in (False, True):
            flat.copy_(inputs[rank])
            out = (
                flat[rank * size : (rank + 1) * size]
                if in_place
                else torch.empty(size, dtype=dtype)
            )
            comm.reduce_scatter(out, flat, op)
            torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=0)
            assert torch.equal(flat[: rank * size], inputs[rank][: rank * size])  # untouched
        # All-gather: rank r contributes r+1 (from its own slice, or elsewhere).
        for in_place in (False, True):
            flat.zero_()
            mine = (
                flat[rank * size : (rank + 1) * size]
                if in_place
                else torch.empty(size, dtype=dtype)
            )
            mine.fill_(rank + 1)
            comm.all_gather(flat, mine)
            want = torch.arange(1, world + 1, dtype=dtype).repeat_interleave(size)
            assert torch.equal(flat, want), (in_place, flat)
        assert torch.all(buffer[:3] == 0)
        assert torch.all(buffer[3 + world * size :] == 0)
    assert calls.count("_symmetric_reduce_scatter") == 4, calls  # the zero-copy paths ran
    assert calls.count("_symmetric_all_gather") == 4, calls


def test_symmetric_buffers_reduce_in_place() -> None:
    spawn(_symmetric_buffers, 3, timeout=90)


def _all_to_all() -> None:
    """Uneven pieces, in several rounds (small slots), an empty one, against
    torch.distributed's all_to_all_single; a rank that sizes an output
    wrongly makes every rank raise, naming it (no rank hangs)."""
    comm = ShmCommunicator(slot_bytes=4096)
    me, world = dist.get_rank(), dist.get_world_size()
    table = torch.randint(0, 3000, (world, world), generator=torch.Generator().manual_seed(7))
    table[0, 1] = 0  # table[r, d]: what rank r sends rank d
    ins = [me * 1e4 + d * 1e3 + torch.arange(int(table[me, d])).float() for d in range(world)]
    outs = [torch.empty(int(table[r, me])) for r in range(world)]
    comm.all_to_all(outs, ins)
    for r, out in enumerate(outs):
        torch.testing.assert_close(out, r * 1e4 + me * 1e3 + torch.arange(out.numel()).float())
    flat = torch.empty(int(table[:, me].sum()))
    dist.all_to_all_single(flat, torch.cat(ins), table[:, me].tolist(), table[me].tolist())
    assert torch.equal(flat, torch.cat(outs))
    wrong = [torch.empty(o.numel() + (me == 1 and r == 0)) for r, o in enumerate(outs)]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] sized their outputs"):
        comm.all_to_all(wrong, ins)
    with pytest.raises(ValueError, match="one dtype"):
        comm.all_to_all(outs, [t.double() for t in ins])
    comm.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_moves_uneven_pieces(world: int) -> None:
    spawn(_all_to_all, world, timeout=60)


def _segment_modes(out: str) -> None:
    """Construct a communicator with os.unlink watched: the mode of each
    segment file when rank 0 removes its name."""
    modes: list[int] = []
    unlink = os.unlink

    def watched(path: str) -> None:
        if os.path.basename(str(path)).startswith("pc-comm-"):
            modes.append(os.stat(path).st_mode & 0o777)
        unlink(path)

    previous = os.umask(0o022)  # the usual umask: files would be 0644
    os.unlink = watched  # type: ignore[assignment]  # this process only
    try:
        comm = ShmCommunicator()
        comm.all_reduce(torch.ones(4))
    finally:
        os.unlink = unlink
        os.umask(previous)
    if dist.get_rank() == 0:
        Path(out).write_text(" ".join(oct(m) for m in modes))


def test_segments_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """Issue 44: another local user must not read a run's gradients from
    /dev/shm (the segments were 0644)."""
    out = tmp_path / "modes"
    spawn(_segment_modes, 2, args=(str(out),), timeout=60)
    modes = out.read_text().split()
    assert modes, "no segment was created"
    assert set(modes) == {"0o600"}, modes
