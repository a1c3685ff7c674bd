"""Per-block activation checkpointing and compile (every plugin's
``activation_checkpointing`` / ``compile`` options, issue 43): a step's
peak memory and time on one process, a Llama of 4 blocks (width 256,
batch 4 x 256 tokens, fp32, AdamW), for no recomputation, full,
selective (matrix products and attention kept) and full on half the
blocks, each eager and compiled (inductor). The peak is every byte the
allocator holds during the second step (``pc_train.peak.step_peak``:
followed from before the model is built); times are the median of paired
rounds after two warm-up steps (compilation excluded).

Run: ``python benchmarks/bench_recompute.py [--iters 6]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pc_booster.plugins.optimizations import apply_block_options
from pc_booster.rules import BlockOptions
from pc_train.peak import step_peak

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "full, half the blocks": {
        "activation_checkpointing": "full",
        "activation_checkpointing_fraction": 0.5,
    },
}


def _model() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _builder(options: dict[str, Any]) -> Callable[[], Callable[[], None]]:
    def build() -> Callable[[], None]:
        model = _model()
        apply_block_options(model, BlockOptions(**options))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    variants = {
        f"{name}{', compiled' if compiled else ''}": {**mode, "compile": compiled}
        for compiled in (False, True)
        for name, mode in MODES.items()
    }
    peaks = {name: step_peak(_builder(options)) for name, options in variants.items()}
    steps = {name: _builder(options)() for name, options in variants.items()}
    for step in steps.values():  # warm-up (and compilation)
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.iters):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    base_peak, base_time = peaks["none"], statistics.median(times["none"])
    lines = [
        "| recomputation | peak MiB | peak / none | step s | step / none |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        step_s = statistics.median(times[name])
        lines.append(
            f"| {name} | {peaks[name] / 2**20:.1f} | {peaks[name] / base_peak:.2f} | "
            f"{step_s:.3f} | {step_s / base_time:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recompute.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
