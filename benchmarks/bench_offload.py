"""pc-offload's CPU optimizer against torch's AdamW on the CPU.

Step time of CPUAdamW vs torch.optim.AdamW(foreach=True) and (fused=True)
on 25 M and 100 M fp32 parameters (a GPT-like mix of tensor sizes), all
threads of the machine, samples alternating between the three. pc over
the best torch variant is given over the medians and paired: the median
over rounds of pc's sample over the faster torch sample of the same round.

``--quick`` (``nox -s bench_quick``): 25 M only, 8 rounds per build, one line.

[Note: placement]
Where a set-up's tensors land in memory moves its step time on this
machine, whatever the code: built in one process in the order pc, foreach,
fused (as this script did until 2026-11-26), pc's step ran at 1.01-1.13x
fused's in eight runs; built last, at 0.95-0.98x; in between, 0.99-1.02x.
The same kernel runs in both (the Python around it differs by 7 us a
step), and moving the four tensors' page offsets apart changed nothing
measurable. So the set-ups are built ``--builds`` times (6: each one
first twice), fresh each time and in a rotated order, and the rounds of
every build are pooled.

    python benchmarks/bench_offload.py [--sizes 25 100] [--iters 10] [--builds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import alternate, pair_line

from pc_offload import CPUAdamW

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
OURS, FOREACH, FUSED = "pc CPUAdamW", "torch AdamW foreach", "torch AdamW fused"


def _params(millions: int) -> list[torch.Tensor]:
    """Blocks of a 1024-wide transformer (4 matrices and a few vectors per
    block) until the total reaches ``millions`` M, plus odd-sized leftovers."""
    gen = torch.Generator().manual_seed(0)
    shapes: list[tuple[int, ...]] = []
    total = 0
    while total < millions * 1_000_000:
        for shape in [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096), (1024,), (4096,)]:
            shapes.append(shape)
            total += int(torch.Size(shape).numel())
    return [torch.randn(shape, generator=gen) for shape in shapes]


SETUPS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    OURS: lambda ps: CPUAdamW(ps, lr=1e-3, weight_decay=0.01),
    FOREACH: lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    FUSED: lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}


def _build(base: list[torch.Tensor], order: list[str]) -> dict[str, Callable[[], object]]:
    """Each set-up's optimizer over fresh copies of ``base`` (gradients
    given, states allocated by one untimed step), built in ``order``."""
    steps: dict[str, Callable[[], object]] = {}
    for name in order:
        params: list[torch.Tensor] = [torch.nn.Parameter(p.clone()) for p in base]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = SETUPS[name](params)
        optimizer.step()
        steps[name] = optimizer.step
    return {name: steps[name] for name in SETUPS}


def _bench(millions: int, iters: int, builds: int) -> dict[str, list[float]]:
    """Seconds per step of each set-up: ``builds`` builds of fresh tensors,
    ``iters`` alternating rounds each, pooled. [Note: placement]: build
    ``b`` starts at set-up ``b`` (rotated), so each one's tensors land in
    each set-up's place in turn. A sample times enough steps to last about
    50 ms."""
    base = _params(millions)
    names = list(SETUPS)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for b in range(builds):
        shift = b % len(names)
        steps = _build(base, names[shift:] + names[:shift])
        start = time.perf_counter()
        steps[FUSED]()
        reps = max(1, math.ceil(0.05 / (time.perf_counter() - start)))
        for name, found in alternate(steps, iters, reps=reps).items():
            samples[name] += found
        del steps  # freed before the next build takes its memory
    return samples


def _paired(samples: dict[str, list[float]]) -> list[float]:
    """pc's sample over the faster torch sample, round by round."""
    return [
        ours / min(foreach, fused)
        for ours, foreach, fused in zip(
            samples[OURS], samples[FOREACH], samples[FUSED], strict=True
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100])
    parser.add_argument("--iters", type=int, default=None, help="rounds per build (10, quick 8)")
    parser.add_argument("--builds", type=int, default=6, help="builds, rotated [Note: placement]")
    parser.add_argument("--quick", action="store_true", help="25 M, pc over best torch only")
    args = parser.parse_args()
    iters = args.iters if args.iters is not None else 8 if args.quick else 10
    RESULTS.mkdir(exist_ok=True)
    if args.quick:
        rounds = _paired(_bench(25, iters, args.builds))
        peer = f"best torch AdamW (foreach / fused), 25 M, {torch.get_num_threads()} threads"
        print(pair_line(OURS, peer, rounds, 1.0))
        return
    print(f"\n## Adam step on the CPU, fp32, {torch.get_num_threads()} threads\n")
    print(
        "| params | pc CPUAdamW (ms) | torch foreach (ms) | torch fused (ms) "
        "| pc / best torch (medians) | pc / best torch (paired) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    results = {}
    for millions in args.sizes:
        samples = _bench(millions, iters, args.builds)
        times = {name: statistics.median(s) for name, s in samples.items()}
        paired = statistics.median(_paired(samples))
        results[millions] = {"times": times, "samples": samples, "paired": paired}
        best = min(times[FOREACH], times[FUSED])
        print(
            f"| {millions} M | {times[OURS] * 1e3:.1f} | {times[FOREACH] * 1e3:.1f} | "
            f"{times[FUSED] * 1e3:.1f} | {times[OURS] / best:.3f} | {paired:.3f} |"
        )
    (RESULTS / "bench_offload.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
