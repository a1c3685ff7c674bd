"""pc-estimate's per-rank peak against the measured one, for every plugin
and tensor / pipeline / sequence-parallel layout (and two-level sharding,
ZeRO-3 over tensor parallelism, recomputation) on this machine's
processes: the calibration table of docs/plugin-guide.md. Each row is one
``pc-estimate --search --trial`` measurement (``pc_train.trial``): the
busiest rank's bytes at its peak in a training step against the estimate.

Run: ``python tools/calibrate_estimate.py [--model llama-small] [--write]``
(about four minutes). Exits 1 when a row is off by more than 10 %.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from pc_train.cost import estimate, model_shape
from pc_train.hardware import DeviceInfo
from pc_train.models import resolve_model
from pc_train.options import PluginKind, PluginOptions
from pc_train.planner import Plan
from pc_train.trial import run_trials

K = PluginKind
# (world, nodes, options): every plugin, every layout the matrix proves at 2-4 ranks.
LAYOUTS: list[tuple[int, int, PluginOptions]] = [
    (2, 1, PluginOptions(K.DDP)),
    (2, 1, PluginOptions(K.ZERO1)),
    (2, 1, PluginOptions(K.ZERO2)),
    (2, 1, PluginOptions(K.FSDP)),
    (2, 1, PluginOptions(K.GEMINI)),
    (2, 1, PluginOptions(K.HYBRID, tp=2, zero_stage=0)),
    (2, 1, PluginOptions(K.HYBRID, tp=2, zero_stage=1)),
    (2, 1, PluginOptions(K.HYBRID, tp=2, zero_stage=1, sequence_parallel=True)),
    (2, 1, PluginOptions(K.HYBRID, pp=2, zero_stage=0)),
    (2, 1, PluginOptions(K.HYBRID, pp=2, zero_stage=1)),
    (2, 1, PluginOptions(K.HYBRID, pp=2, zero_stage=1, pp_style="interleaved")),
    (2, 1, PluginOptions(K.HYBRID, pp=2, zero_stage=1, pp_style="zbv")),
    (2, 1, PluginOptions(K.HYBRID, sp=2, zero_stage=1)),
    (2, 1, PluginOptions(K.HYBRID, sp=2, zero_stage=1, sp_mode="ring_attn")),
    (2, 1, PluginOptions(K.ZERO2, activation_checkpointing="full")),
    (2, 1, PluginOptions(K.ZERO2, activation_checkpointing="selective")),
    (2, 1, PluginOptions(K.FSDP, activation_checkpointing="full")),
    (4, 1, PluginOptions(K.FSDP, tp=2)),
    (4, 1, PluginOptions(K.GEMINI, tp=2)),
    (4, 1, PluginOptions(K.HYBRID, tp=2, pp=2, zero_stage=1)),
    (4, 2, PluginOptions(K.ZERO2, extra_dp=2)),
    (4, 2, PluginOptions(K.GEMINI, extra_dp=2)),
    # Adam's moments stored narrow (pc_offload's [Note: low-precision optimizer states]).
    (2, 1, PluginOptions(K.ZERO2, optimizer_states="bf16")),
    (2, 1, PluginOptions(K.ZERO2, optimizer_states="int8")),
    (2, 1, PluginOptions(K.GEMINI, optimizer_states="bf16")),
    (2, 1, PluginOptions(K.GEMINI, optimizer_states="int8")),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--only", type=int, nargs="*", help="row numbers (1-based) to run")
    args = parser.parse_args()
    spec = resolve_model(args.model, args.seq_len)
    shape = model_shape(spec)
    rows, worst, speeds = [], 0.0, []
    print(
        "| world | layout | predicted | measured | predicted / measured "
        "| tokens/s predicted | measured | predicted / measured |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for number, (world, nodes, options) in enumerate(LAYOUTS, start=1):
        if args.only and number not in args.only:
            continue
        if options.pp > 1:  # a pipeline's estimate is per micro-batch of `pp` in flight
            options = replace(options, microbatches=options.pp)
        device = DeviceInfo.detect(world, args.precision)
        predicted = estimate(
            shape, options, world, args.micro_batch, args.seq_len, args.precision, device
        )
        plan = Plan(options, args.micro_batch, 1, predicted)
        (trial,) = run_trials(spec, [plan], world, nodes, args.seq_len, args.precision)
        worst = max(worst, abs(trial.ratio - 1))
        line = (
            f"| {world} | {options.describe()}{f' ({nodes} nodes)' if nodes > 1 else ''} | "
            f"{predicted.device_bytes / 2**20:.1f} MiB | {trial.measured_bytes / 2**20:.1f} MiB | "
            f"{trial.ratio:.3f} | {plan.tokens_per_second:,.0f} | "
            f"{plan.tokens_per_second / trial.speed_ratio:,.0f} | {trial.speed_ratio:.2f} |"
        )
        speeds.append(trial.speed_ratio)
        rows.append(line)
        print(line, flush=True)
    print(f"\nworst: {worst:.1%} off")
    if speeds:
        far = max(speeds, key=lambda r: abs(r - 1))
        print(f"tokens/s: predicted / measured from {min(speeds):.2f} to {max(speeds):.2f} "
              f"(farthest {far:.2f})")  # fmt: skip
    return 1 if worst > 0.10 else 0


if __name__ == "__main__":
    sys.exit(main())
