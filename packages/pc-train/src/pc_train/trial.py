"""``pc-estimate --trial K``: the planner's first K plans run for a step on
this machine's processes, each rank's peak measured (every byte it holds,
:func:`pc_train.peak.step_peak`) and set beside the prediction; then a few
more steps timed (outside the profiler), the slowest rank's median step."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_train.models import ModelSpec, build_model
from pc_train.options import PluginOptions
from pc_train.peak import step_peak
from pc_train.planner import Plan

__all__ = ["Trial", "run_trials"]


@dataclass(frozen=True)
class Trial:
    """A plan's predicted and measured per-rank peak (the busiest rank's),
    and its measured seconds per step (the slowest rank's median)."""

    plan: Plan
    measured_bytes: int
    measured_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.plan.estimate.device_bytes / self.measured_bytes

    @property
    def speed_ratio(self) -> float:
        """Predicted tokens/s over measured (> 1: the estimate is optimistic)."""
        return self.measured_seconds / self.plan.step_seconds


_TIMED_STEPS = 9


def _measure(
    out: str, spec: ModelSpec, options: PluginOptions, micro: int, seq: int, precision: str,
    per_node: int,
) -> None:  # fmt: skip
    """One rank of a trial: build, boost, two steps; the second's peak."""
    from pc_booster import Booster

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # the simulated node
    pipeline = options.pp > 1
    chunks = options.microbatches or options.pp if pipeline else 1
    clip = 0.0 if pipeline or options.step_in_backward or options.ep > 1 else 1.0

    def build() -> Any:
        plugin = options.make(max_norm=clip)
        booster = Booster(plugin=plugin, mixed_precision=None if precision == "fp32" else precision)
        net = build_model(spec, seed=0, lazy=True)  # as pc-train builds it
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
        net, optimizer, *_ = booster.boost(net, optimizer)
        vocab = spec.vocab_size
        ids = torch.randint(
            0, vocab, (micro * chunks, seq), generator=torch.Generator().manual_seed(0)
        )

        def step() -> None:
            if pipeline:
                booster.execute_pipeline(iter([{"input_ids": ids}]), net, None, optimizer)
            else:
                booster.backward(net(input_ids=ids, labels=ids).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()

        return step

    steps: list[Any] = []

    def kept() -> Any:
        steps.append(build())  # kept for the timed steps
        return steps[-1]

    held = torch.tensor([float(step_peak(kept))])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    dist.barrier()
    times = []
    for _ in range(_TIMED_STEPS):
        start = time.perf_counter()
        steps[-1]()
        times.append(time.perf_counter() - start)
    # The median step: on a shared machine a step now and then is slowed by
    # something else (3 steps' mean moved by up to 70 % between runs).
    seconds = torch.tensor([statistics.median(times)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"measured": int(held), "seconds": float(seconds)}))


def run_trials(
    spec: ModelSpec, plans: list[Plan], world: int, nodes: int, seq_len: int, precision: str
) -> list[Trial]:
    """Each plan for one step on ``world`` local processes (``nodes``
    simulated nodes of consecutive ranks), its busiest rank's peak."""
    from pc_comm.testing import spawn

    trials = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, plan in enumerate(plans):
            out = str(Path(scratch) / f"trial{index}.json")
            args = (out, spec, plan.options, plan.micro_batch, seq_len, precision, world // nodes)
            spawn(_measure, world, args=args, timeout=900)
            found = json.loads(Path(out).read_text())
            trials.append(Trial(plan, int(found["measured"]), float(found["seconds"])))
    return trials
