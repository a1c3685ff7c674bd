"""The futex wait behind the shared-memory barrier: a wake ends it, a word
that already changed never sleeps, and the timeout bounds it."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from pc_comm import _futex

pytestmark = pytest.mark.skipif(not _futex.AVAILABLE, reason="futexes are Linux-only")


def _word() -> tuple[torch.Tensor, ctypes.Array[ctypes.c_int64]]:
    backing = torch.zeros(16, dtype=torch.int64)
    return backing, (ctypes.c_int64 * 16).from_address(backing.data_ptr())


def test_wake_ends_the_wait() -> None:
    backing, word = _word()
    address = ctypes.addressof(word)

    def bump() -> None:
        time.sleep(0.2)
        word[0] = 1
        _futex.wake(address)

    waker = threading.Thread(target=bump)
    start = time.monotonic()
    waker.start()
    while word[0] == 0:
        _futex.wait(address, 0, 30.0)
    waited = time.monotonic() - start
    waker.join()
    assert waited < 15.0, f"the wake did not end the wait ({waited:.1f} s of a 30 s timeout)"
    assert int(backing[0]) == 1


def test_changed_word_returns_at_once_and_timeout_bounds_the_wait() -> None:
    backing, word = _word()
    address = ctypes.addressof(word)
    word[0] = 7
    start = time.monotonic()
    _futex.wait(address, 6, 30.0)  # the word no longer holds 6
    assert time.monotonic() - start < 15.0
    start = time.monotonic()
    _futex.wait(address, 7, 0.05)  # nobody wakes: the timeout ends it
    assert time.monotonic() - start >= 0.04
    # The comparison is on the low 32 bits, as the kernel sees the word.
    word[0] = (5 << 32) + 3
    start = time.monotonic()
    _futex.wait(address, 3, 0.05)
    assert time.monotonic() - start >= 0.04
    assert int(backing[0]) == (5 << 32) + 3


def test_a_failing_wait_raises() -> None:
    backing, word = _word()
    misaligned = ctypes.addressof(word) + 1  # the kernel refuses it (EINVAL)
    with pytest.raises(OSError, match="futex wait failed"):
        _futex.wait(misaligned, 0, 1.0)
    assert int(backing[0]) == 0


def _barrier_without_futex() -> None:
    import torch.distributed as dist

    from pc_comm import ReduceOp, ShmCommunicator

    def refuse(address: int, seen: int, timeout_s: float) -> None:
        raise OSError(38, "futex wait failed: refused on purpose")

    _futex.wait = refuse  # as in a sandbox that lets the probe through
    comm = ShmCommunicator()
    rank = dist.get_rank()
    for step in range(5):
        if rank == 1:
            time.sleep(0.05)  # rank 0 must wait, so it tries the futex
        x = torch.full((1000,), float(rank + step))
        comm.all_reduce(x, ReduceOp.SUM)
        torch.testing.assert_close(x, torch.full((1000,), float(2 * step + 1)), rtol=0, atol=0)
    if rank == 0:  # it waited 50 ms each step: past its polls, into the wait
        assert comm._use_futex is False
    comm.close()


def test_barrier_falls_back_to_naps_when_the_wait_fails() -> None:
    from pc_comm.testing import spawn

    spawn(_barrier_without_futex, 2, timeout=60)
