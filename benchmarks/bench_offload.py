"""pc-offload's CPU optimizer against torch's AdamW on the CPU.

Step time of CPUAdamW vs torch.optim.AdamW(foreach=True) and (fused=True)
on 25 M and 100 M fp32 parameters (a GPT-like mix of tensor sizes), all
threads of the machine, samples alternating between the three.

    python benchmarks/bench_offload.py [--sizes 25 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from _common import alternate

from pc_offload import CPUAdamW

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"


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


def _bench(millions: int, iters: int) -> dict[str, float]:
    base = _params(millions)
    setups: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "pc CPUAdamW": lambda ps: CPUAdamW(ps, lr=1e-3, weight_decay=0.01),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(
            ps, lr=1e-3, weight_decay=0.01, foreach=True
        ),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(
            ps, lr=1e-3, weight_decay=0.01, fused=True
        ),
    }
    steps: dict[str, Callable[[], None]] = {}
    for name, make in setups.items():
        params: list[torch.Tensor] = [torch.nn.Parameter(p.clone()) for p in base]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = make(params)
        optimizer.step()  # states allocated outside the timing
        steps[name] = optimizer.step
    samples = alternate(steps, iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    print(f"\n## Adam step on the CPU, fp32, {torch.get_num_threads()} threads\n")
    print("| params | pc CPUAdamW (ms) | torch foreach (ms) | torch fused (ms) | pc / best torch |")
    print("|---:|---:|---:|---:|---:|")
    results = {}
    for millions in args.sizes:
        times = _bench(millions, args.iters)
        results[millions] = times
        best = min(times["torch AdamW foreach"], times["torch AdamW fused"])
        print(
            f"| {millions} M | {times['pc CPUAdamW'] * 1e3:.1f} | "
            f"{times['torch AdamW foreach'] * 1e3:.1f} | {times['torch AdamW fused'] * 1e3:.1f} | "
            f"{times['pc CPUAdamW'] / best:.3f} |"
        )
    (RESULTS / "bench_offload.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
