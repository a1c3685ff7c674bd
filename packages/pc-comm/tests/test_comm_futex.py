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
