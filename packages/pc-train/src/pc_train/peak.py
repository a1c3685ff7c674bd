"""A rank's peak memory in one training step, as every byte it holds: the
allocator's tensors (reported to torch's profiler, followed allocation by
allocation from before the model is built) and the shared-memory buffers
pc-comm hands out for gradients and parameters (its symmetric memory,
counted as ``ShmCommunicator.alloc`` gives it). pc-comm's own staging
segments (a communicator's workspace, as NCCL's buffers on a GPU) are not
counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["step_peak"]

_MARK = "pc_measured_step"


@contextmanager
def _symmetric_bytes() -> Iterator[list[int]]:
    """The bytes ``ShmCommunicator.alloc`` hands this rank while open."""
    from pc_comm import shm

    counted = [0]
    original = shm.ShmCommunicator.alloc

    def alloc(self: Any, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = original(self, numel, dtype)
        counted[0] += tensor.numel() * tensor.element_size()
        return tensor

    shm.ShmCommunicator.alloc = alloc  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        shm.ShmCommunicator.alloc = original  # type: ignore[method-assign]


def step_peak(build: Callable[[], Callable[[], None]]) -> int:
    """``build()`` makes the model, optimizer and plugin and returns one
    training step; the step runs twice (the first makes the optimizer
    states) and the peak of the bytes held during the second is returned."""
    with (
        _symmetric_bytes() as symmetric,
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step = build()
        step()
        with torch.profiler.record_function(_MARK):
            step()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    assert results is not None
    events: list[tuple[int, int, int]] = []
    window = (0, 0)
    stack = [(event, "") for event in results.experimental_event_tree()]
    while stack:
        event, parent = stack.pop()
        if event.name == _MARK:
            window = (int(event.start_time_ns), int(event.end_time_ns))
        if str(event.tag).endswith("Allocation") and parent != "aten::from_file":
            fields = event.extra_fields
            if fields.device.type == "cpu":
                events.append((int(event.start_time_ns), int(fields.alloc_size), int(fields.ptr)))
        stack.extend((child, event.name) for child in event.children)
    events.sort()
    live: dict[int, int] = {}
    held = peak = 0
    for when, size, ptr in events:
        if size > 0:
            live[ptr] = size
            held += size
        else:
            held -= live.pop(ptr, 0)
        if window[0] <= when <= window[1]:
            peak = max(peak, held)
    return peak + symmetric[0]
