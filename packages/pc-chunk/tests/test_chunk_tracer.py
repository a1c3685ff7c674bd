"""MemoryTracer's CPU accounting against torch's profiler (a different
mechanism: the allocator's per-event memory) on a tiny GPT-2 step."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pc_chunk.tracer import MemoryTracer
from pc_comm.testing import tiny_gpt2

pytestmark = pytest.mark.timeout(120)


def _profiled_by_op(step: object, ops: set[str]) -> dict[str, int]:
    """Bytes the profiler saw allocated, each event's self memory charged to
    its nearest enclosing operator that the tracer also names (kernels
    allocate through child events such as aten::empty)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()  # type: ignore[operator]
    totals: dict[str, int] = {}
    for event in prof.events():
        if event.self_cpu_memory_usage <= 0:
            continue
        node = event
        while node is not None and node.name.removeprefix("aten::") not in ops:
            node = node.cpu_parent
        key = node.name.removeprefix("aten::") if node is not None else "<other>"
        totals[key] = totals.get(key, 0) + event.self_cpu_memory_usage
    return totals


def test_per_operator_figures_match_the_profiler() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2()
    ids = torch.randint(0, 97, (4, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up outside both measurements
    tracer = MemoryTracer(model)
    tracer.trace(step)
    ours = tracer.allocated_by_op()
    theirs = _profiled_by_op(step, set(ours))
    total_ours, total_theirs = sum(ours.values()), sum(theirs.values())
    assert abs(total_ours - total_theirs) <= 0.1 * total_theirs, (total_ours, total_theirs)
    # Operators whose only allocations are their outputs agree to the byte.
    # Known gaps, left open (issue 5): kernels' internal temporaries
    # (scaled-dot-product attention, embedding backward) are invisible to
    # storage accounting, and the profiler does not see the autograd
    # engine's gradient-accumulation adds.
    for op in ["mm", "addmm", "mul", "pow", "tanh", "tanh_backward", "cat", "_log_softmax"]:
        assert ours[op] == theirs[op], (op, ours[op], theirs[op])
    exact = sum(b for op, b in ours.items() if b == theirs.get(op, 0))
    assert exact >= 0.7 * total_ours, (exact, total_ours)
    peaks = tracer.non_model_bytes()
    assert peaks["transformer.h.0.mlp"] > 0
    assert all(r.live_bytes >= 0 for r in tracer.records)
