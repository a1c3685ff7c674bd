"""ZeRO-1/2 step time against its peers, side by side in one run.

GPT-2 (6 layers, hidden 512, 8 heads, vocab 8192, sequence 256, batch 4 per
rank, fp32, AdamW, one thread per rank, 2 ranks), the configuration of the
DDP benchmark. Rows, sampled alternately:

- single process (rank 0 alone; the others wait);
- 2 processes, no communication (what sharing the machine costs);
- pc LowLevelZeroOptimizer stage 1 and stage 2 (shared memory);
- torch DDP + ZeroRedundancyOptimizer (gloo);
- DeepSpeed ZeRO stage 1 and 2 (gloo, CPU accelerator), when deepspeed
  imports in this environment (`nox -s bench` installs it).

Every row is also given over torch's ZeroRedundancyOptimizer, paired.
``--quick`` (``nox -s bench_quick``): only the single process, the floor,
pc ZeRO-2 and torch's, and one line: pc ZeRO-2 over torch, paired.

    python benchmarks/bench_zero.py [--iters 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    alternate,
    deepspeed_gpt2,
    pair_line,
    paired_ratios,
    print_step_table,
    rounds_against,
    step_gpt2,
    step_times,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from pc_comm.testing import spawn
from pc_zero import LowLevelZeroOptimizer

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
OURS, PEER = "pc ZeRO-2 (shm)", "torch DDP + ZeroRedundancyOptimizer (gloo)"


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(seed))


def _plain(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int
) -> Callable[[], None]:
    batch = _batch(seed)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    return step


def _ours(stage: int, seed: int) -> Callable[[], None]:
    model = step_gpt2()
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), stage=stage, reduce_bucket_size=2**22
    )
    batch = _batch(seed)

    def step() -> None:
        opt.zero_grad()
        opt.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()

    return step


def _torch_zero(seed: int) -> Callable[[], None]:
    model = torch.nn.parallel.DistributedDataParallel(step_gpt2())
    opt = ZeroRedundancyOptimizer(
        list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-4
    )
    return _plain(model, opt, seed)


def _deepspeed(stage: int, seed: int) -> Callable[[], None] | None:
    found = deepspeed_gpt2({"stage": stage, "reduce_bucket_size": 2**22}, _batch(seed))
    return found[0] if found is not None else None


def _steps(iters: int, out: str, quick: bool) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = step_gpt2()
    alone = _plain(model, torch.optim.AdamW(model.parameters(), lr=1e-4), rank)
    steps: dict[str, Callable[[], None]] = {
        "single process": alone if rank == 0 else lambda: None,
        "2 processes, no communication": alone,
    }
    if not quick:
        steps["pc ZeRO-1 (shm)"] = _ours(1, rank)
    steps[OURS] = _ours(2, rank)
    steps[PEER] = _torch_zero(rank)
    for stage in () if quick else (1, 2):
        ds = _deepspeed(stage, rank)
        if ds is not None:
            steps[f"DeepSpeed ZeRO-{stage} (gloo)"] = ds
    for fn in steps.values():
        fn()  # warm-up: optimizer states exist from here on
    samples = alternate(steps, iters, sync=True)
    times, ratios = step_times(samples), paired_ratios(samples)
    vs_peer = rounds_against(samples, PEER)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "ratios": ratios, "vs_peer": vs_peer}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="pc ZeRO-2 over torch's only")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("zero_quick.json" if args.quick else "zero_step.json")
    spawn(_steps, 2, args=(args.iters, str(out), args.quick), timeout=3000)
    found = json.loads(out.read_text())
    if args.quick:
        floor = found["ratios"]["2 processes, no communication"]
        print(f"ZeRO-2 floor (2 processes, no communication / single process): {floor:.3f} paired")
    else:
        title = "ZeRO step, GPT-2 6x512, batch 4x256 per rank, fp32 AdamW, 2 ranks, 1 thread each"
        print_step_table(title, found["times"], found["ratios"], (PEER, found["vs_peer"]))
    print(pair_line(OURS, PEER, found["vs_peer"][OURS], 1.0))


if __name__ == "__main__":
    main()
