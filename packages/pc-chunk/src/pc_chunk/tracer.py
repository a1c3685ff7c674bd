"""Non-model memory per operator, recorded during a warm-up step.

[Note: tracing]
``MemoryTracer(model).trace(fn)`` runs ``fn`` (a forward and backward)
under torch's profiler with memory profiling on. The allocator reports
every allocation and free to the profiler, with its size and the
allocator's running total: on the CPU from c10's CPU allocator, on CUDA
from the caching allocator. That is the measurement; the tracer only
attributes it:

- each allocation is charged to the top-level aten operator it happened
  in (``aten::linear``, ``aten::mm`` inside a backward node, ...), so a
  kernel's internal temporaries count (scaled-dot-product attention's
  per-thread buffers, embedding backward's sort) as well as its outputs;
- forward operators are tagged with the module that ran them (a
  ``record_function`` label pushed by module hooks);
- model data is subtracted: gradients become model data when autograd
  assigns them to ``.grad`` (a post-accumulate-grad hook marks the moment)
  and stop being so when freed.

Only memory allocated during the trace counts, so what was alive before
(the parameters, an optimizer's states) is not "non-model memory" here.

No dispatch mode is involved: passing every tensor through Python changes
the step it measures (autograd can no longer steal a gradient buffer for
in-place accumulation, which costs about 8% more memory on a tiny GPT-2).

``non_model_bytes()`` gives, per module, the peak non-model memory while it
ran: the figures :class:`~pc_chunk.manager.AutoPlacement` makes room for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

__all__ = ["MemoryTracer", "OpRecord", "measure_peak"]

T = TypeVar("T")

_MODULE = "pc_module#"
_GRAD = "pc_grad#"


@dataclass(frozen=True)
class OpRecord:
    """One top-level operator call, in bytes: what it allocated
    (temporaries included), the peak non-model memory while it ran, and the
    non-model memory alive after it. ``module`` is the innermost module
    running it in the forward pass, ``""`` in backward."""

    op: str
    module: str
    allocated_bytes: int
    peak_bytes: int
    live_bytes: int


@dataclass
class _Op:
    name: str
    module: str
    start: int
    end: int
    allocated: int = 0
    peak: int = 0
    live: int = 0


@dataclass(frozen=True)
class _Event:
    time: int
    owner: int  # index into the operator list, -1 outside any operator
    ptr: int
    size: int  # negative for a free; 0 marks a gradient becoming model data
    total: int  # the allocator's running total; a gradient marker's bytes


@contextmanager
def _label(name: str) -> Iterator[None]:
    handle = torch.ops.profiler._record_function_enter_new(name, None)
    try:
        yield
    finally:
        torch.ops.profiler._record_function_exit(handle)


class MemoryTracer:
    """Records non-model memory per operator [Note: tracing]."""

    def __init__(self, model: nn.Module, device: torch.device | str | None = None) -> None:
        self.model = model
        first = next(model.parameters(), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.records: list[OpRecord] = []
        self._grads: list[tuple[int, int]] = []  # (address, bytes) per marker

    # -- running -------------------------------------------------------------------

    def trace(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one training step) and record every operator."""
        hooks: list[Any] = []
        handles: list[Any] = []
        self._grads = []

        def enter(name: str) -> Callable[[nn.Module, Any], None]:
            def hook(_module: nn.Module, _args: Any) -> None:
                handles.append(torch.ops.profiler._record_function_enter_new(name, None))

            return hook

        def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
            if handles:
                torch.ops.profiler._record_function_exit(handles.pop())

        def grad_ready(param: torch.Tensor) -> None:
            if param.grad is not None and param.grad.device == self.device:
                storage = param.grad.untyped_storage()
                with _label(f"{_GRAD}{len(self._grads)}"):
                    self._grads.append((storage.data_ptr(), storage.nbytes()))

        for name, module in self.model.named_modules():
            hooks.append(module.register_forward_pre_hook(enter(_MODULE + (name or "<root>"))))
            hooks.append(module.register_forward_hook(leave))
        for param in self.model.parameters():
            if param.requires_grad:
                hooks.append(param.register_post_accumulate_grad_hook(grad_ready))  # type: ignore[no-untyped-call]
        activities = [ProfilerActivity.CPU]
        try:
            with profile(activities=activities, profile_memory=True) as prof:
                result = fn()
        finally:
            for hook in hooks:
                hook.remove()
            while handles:
                torch.ops.profiler._record_function_exit(handles.pop())
        self.records = self._settle(prof)
        return result

    # -- attribution -----------------------------------------------------------------

    def _collect(self, prof: profile) -> tuple[list[_Op], list[_Event]]:
        results = prof.profiler.kineto_results if prof.profiler is not None else None
        if results is None:
            raise RuntimeError("MemoryTracer: the profiler returned no results")
        ops: list[_Op] = []
        events: list[_Event] = []
        # (event, module label, index of the enclosing top-level operator)
        stack: list[tuple[Any, str, int]] = [
            (root, "", -1) for root in results.experimental_event_tree()
        ]
        while stack:
            event, module, owner = stack.pop()
            name = str(event.name)
            if str(event.tag).endswith("Allocation"):
                fields = event.extra_fields
                if fields.device == self.device or (
                    fields.device.type == self.device.type == "cuda" and self.device.index is None
                ):
                    events.append(
                        _Event(
                            int(event.start_time_ns),
                            owner,
                            int(fields.ptr),
                            int(fields.alloc_size),
                            int(fields.total_allocated),
                        )
                    )
                continue
            if name.startswith(_MODULE):
                module = name.removeprefix(_MODULE)
            elif name.startswith(_GRAD):
                ptr, nbytes = self._grads[int(name.removeprefix(_GRAD))]
                events.append(_Event(int(event.start_time_ns), -1, ptr, 0, nbytes))
            elif owner < 0 and name.startswith("aten::"):
                owner = len(ops)
                ops.append(
                    _Op(
                        name.removeprefix("aten::"),
                        module,
                        int(event.start_time_ns),
                        int(event.end_time_ns),
                    )
                )
            stack.extend((child, module, owner) for child in event.children)
        events.sort(key=lambda e: (e.time, e.size == 0))
        return ops, events

    def _settle(self, prof: profile) -> list[OpRecord]:
        ops, events = self._collect(prof)
        order = sorted(range(len(ops)), key=lambda i: ops[i].start)
        allocations = [e for e in events if e.size != 0]
        # The allocator's running total before the trace's first allocation.
        base = allocations[0].total - allocations[0].size if allocations else 0
        total = base
        in_trace: set[int] = set()  # addresses whose last event was an allocation
        model: dict[int, int] = {}  # in-trace storages that are gradients now
        model_bytes = 0
        index = 0
        for number in order:
            op = ops[number]
            op.peak = total - base - model_bytes
            while index < len(events) and events[index].time <= op.end:
                event = events[index]
                index += 1
                if event.size == 0:  # a gradient assigned to .grad
                    if event.ptr in in_trace and event.ptr not in model:
                        model[event.ptr] = event.total
                        model_bytes += model[event.ptr]
                    continue
                total = event.total
                if event.size > 0:
                    in_trace.add(event.ptr)
                else:
                    in_trace.discard(event.ptr)
                    model_bytes -= model.pop(event.ptr, 0)
                if event.owner == number:
                    op.allocated += max(event.size, 0)
                    op.peak = max(op.peak, total - base - model_bytes)
            op.live = total - base - model_bytes
        return [
            OpRecord(ops[i].name, ops[i].module, ops[i].allocated, ops[i].peak, ops[i].live)
            for i in order
        ]

    # -- figures -------------------------------------------------------------------

    def non_model_bytes(self) -> dict[str, int]:
        """Peak non-model bytes alive while each module ran (forward),
        counting the operators of its submodules and their temporaries."""
        peaks: dict[str, int] = {}
        for record in self.records:
            if not record.module:
                continue
            parts = record.module.split(".")
            for depth in range(1, len(parts) + 1):
                name = ".".join(parts[:depth])
                peaks[name] = max(peaks.get(name, 0), record.peak_bytes)
        return peaks

    def allocated_by_op(self) -> dict[str, int]:
        """Total bytes each top-level operator allocated over the traced
        step, temporaries included."""
        totals: dict[str, int] = {}
        for record in self.records:
            totals[record.op] = totals.get(record.op, 0) + record.allocated_bytes
        return totals


def measure_peak(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak bytes allocated on
    ``device`` above the level when it started, as the allocator reported
    them to the profiler (every tensor, not only the ones a module owns)."""
    device = torch.device(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("measure_peak: the profiler returned no results")
    events: list[tuple[int, int, int]] = []
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if str(event.tag).endswith("Allocation"):
            fields = event.extra_fields
            if fields.device.type == device.type and (
                device.index is None or fields.device.index == device.index
            ):
                events.append(
                    (int(event.start_time_ns), int(fields.alloc_size), int(fields.total_allocated))
                )
        stack.extend(event.children)
    if not events:
        return result, 0
    events.sort()
    base = events[0][2] - events[0][1]
    return result, max(0, max(total for _, _, total in events) - base)
