"""The host communicators' worker thread: once an operation is waited for,
the worker holds none of its tensors."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import torch

from pc_comm._host import HostExecutor


def test_a_waited_operation_holds_none_of_its_tensors() -> None:
    """A buffer the caller drops after ``wait()`` is freed at once, on the
    caller's thread: a memory profiler of that thread sees the free, so a
    measured peak does not depend on which thread let go last (ZeRO-2 drops
    its staging buffers right after waiting for their reductions)."""
    executor = HostExecutor("pc-test-executor")
    checked = threading.Event()
    try:
        buffer = torch.ones(1024)
        ref = weakref.ref(buffer)

        def work(b: torch.Tensor = buffer) -> None:
            b.add_(1)

        handle = executor._submit(work, async_op=True)
        del work
        future: Future[None] = handle._future  # type: ignore[attr-defined]
        # Runs on the worker right after the result is set: the worker is
        # held there until this test has looked.
        future.add_done_callback(lambda _: checked.wait(10))
        handle.wait()
        assert float(buffer[0]) == 2.0
        del buffer
        alive = ref() is not None
    finally:
        checked.set()
        executor.close()
    assert not alive, "the worker thread still held the operation's tensor after wait()"
