"""Every Booster plugin on the same model and step, side by side in one run:
step time and the model-state bytes each rank holds (parameters, gradients
and optimizer states), the numbers behind the plugin-selection guide.

GPT-2 (6 layers, hidden 512, 8 heads, vocab 8192, sequence 256, batch 4 per
data-parallel rank, fp32, AdamW), 2 ranks with one thread each on CPU. The
tensor-parallel plugin has one data-parallel rank here, so its step covers
half the tokens: compare tokens/s.

    python benchmarks/bench_booster.py [--iters 5]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import alternate, step_gpt2, step_times

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import spawn
from pc_train.estimate import measured_model_state_bytes

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch DDP": TorchDDPPlugin,
    "pc DDP (hfreduce-style)": DDPPlugin,
    "ZeRO-1": partial(LowLevelZeroPlugin, stage=1),
    "ZeRO-2": partial(LowLevelZeroPlugin, stage=2),
    "torch FSDP2": TorchFSDPPlugin,
    "Gemini": GeminiPlugin,
    "hybrid tp 2": partial(HybridParallelPlugin, tp_size=2),
}


def _run(iters: int, out: str) -> None:
    torch.set_num_threads(1)
    fns: dict[str, Callable[[], None]] = {}
    sizes: dict[str, int] = {}
    tokens: dict[str, int] = {}  # per step, over the data-parallel ranks
    for name, make in PLUGINS.items():
        booster = Booster(plugin=make())
        model = step_gpt2()
        model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        group = booster.plugin.dp_group
        seed = dist.get_rank(group)
        tokens[name] = 4 * 256 * dist.get_world_size(group)
        ids = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(seed))

        def step(model: Any = model, optimizer: Any = optimizer, booster: Booster = booster,
                 ids: torch.Tensor = ids) -> None:  # fmt: skip
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        step()  # warm-up, and the optimizer states exist
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)  # gradients held, as at their peak
        size = torch.tensor([measured_model_state_bytes(model, optimizer)], dtype=torch.float64)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        sizes[name] = int(size)
        optimizer.zero_grad()
        fns[name] = step
    times = step_times(alternate(fns, iters, sync=True))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "bytes": sizes, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "booster.json"
    spawn(_run, 2, args=(args.iters, str(out)), timeout=3000)
    result = json.loads(out.read_text())
    times, sizes, tokens = result["times"], result["bytes"], result["tokens"]
    base = tokens["torch DDP"] / times["torch DDP"]
    print("\n## Booster plugins: GPT-2 6 x 512, vocab 8192, 2 CPU ranks, fp32 AdamW\n")
    print("| plugin | step (s) | tokens / step | tokens/s | / torch DDP | states per rank (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds in times.items():
        rate = tokens[name] / seconds
        print(
            f"| {name} | {seconds:.3f} | {tokens[name]} | {rate:.0f} | {rate / base:.3f} | "
            f"{sizes[name] / 2**20:.1f} |"
        )
    (RESULTS / "bench_booster.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
