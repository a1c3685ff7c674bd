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

from pc_comm import ReduceOp, ShmCommunicator
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


def _killed_mid_collective() -> None:
    comm = ShmCommunicator(slot_bytes=4096, timeout=timedelta(seconds=30))
    big = torch.ones(1_000_000)
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
    assert "ShmPeerError: rank 1 (pid" in message
    assert "died; rank 0 was waiting for it in shared-memory all_reduce" in message
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
    assert "ShmPeerError: rank(s) [1] did not reach shared-memory all_reduce within 2 s" in message


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
    with pytest.raises(NotImplementedError, match="use TorchCommunicator for send/recv"):
        comm.send(torch.ones(1), 0)
    comm.barrier()


def test_bad_input_is_rejected() -> None:
    spawn(_bad_input, 2, timeout=60)
