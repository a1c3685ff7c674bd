"""``pc-estimate``: per-rank memory and step time of a model under each
plugin, before anything runs, and the plugin to use with its reasons.

This module is the command line; the cost model it prints is
:mod:`pc_train.cost` and the machines it is for :mod:`pc_train.hardware`
(their public names are importable from here too).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields, replace

from pc_train.cost import (
    Estimate,
    ModelShape,
    Recommendation,
    estimate,
    gib_text,
    measured_model_state_bytes,
    model_shape,
    recommend,
)
from pc_train.hardware import (
    GPUS,
    DeviceInfo,
    GiB,
    cpu_peak_flops,
    disk_bandwidth,
    gpu_device,
    gpu_peak_flops,
)
from pc_train.models import MODEL_PRESETS, ModelSpec, resolve_model
from pc_train.options import (
    PRECISIONS,
    LayoutOptions,
    PluginKind,
    PluginOptions,
    add_layout_flags,
)
from pc_train.planner import Cluster, search
from pc_train.trial import Trial

__all__ = [
    "GPUS",
    "DeviceInfo",
    "Estimate",
    "GiB",
    "ModelShape",
    "Recommendation",
    "cpu_peak_flops",
    "estimate",
    "gpu_device",
    "gpu_peak_flops",
    "main",
    "measured_model_state_bytes",
    "model_shape",
    "recommend",
]


def _table(estimates: Sequence[Estimate]) -> str:
    rows = [
        "| plugin | params/rank | model states | of which host | of which disk | activations "
        "| step (s) | fits | async save | full save |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for e in estimates:
        rows.append(
            f"| {e.plugin} | {e.params_per_rank:,} | {gib_text(e.model_state_bytes)} | "
            f"{gib_text(e.host_bytes)} | {gib_text(e.disk_bytes)} | "
            f"{gib_text(e.activation_bytes)} | {e.step_seconds:.3g} | "
            f"{'yes' if e.fits else 'no'} | {gib_text(e.async_save_bytes)} | "
            f"{gib_text(e.full_save_bytes)} |"
        )
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pc-estimate",
        description="Predict per-rank memory and step time of a model under each plugin, "
        "and recommend one.",
    )
    parser.add_argument(
        "--model",
        default="gpt2-small",
        help=f"one of {', '.join(MODEL_PRESETS)}, a config .json or a save_pretrained directory",
    )
    parser.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="sequences per data-parallel rank"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument(
        "--plugin", default=None, help="estimate this plugin only (with --tp/--pp/--zero-stage)"
    )
    # The layout's flags, as pc-train's: one name, one default, one help each.
    add_layout_flags(parser, suppress_defaults=False)
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="memory per rank (default: this machine's, or the --gpu's)",
    )
    parser.add_argument(
        "--gpu", choices=GPUS, default=None, help="estimate for this GPU (default: this machine)"
    )
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="host memory per rank, checked with a GPU (default: this machine's with no "
        "--gpu, unchecked with one)",
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="search every layout (data, ZeRO stage, two-level sharding, tensor, pipeline and "
        "sequence parallelism, recomputation, micro-batch) and rank the plans that fit",
    )
    parser.add_argument(
        "--nodes", type=int, default=1, help="with --search: nodes the --world ranks span"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="with --search: sequences per step (default: --micro-batch x --world)",
    )
    parser.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="with --search: GB/s per rank between nodes (default: 50 for H100/H200, 25 for "
        "A100, a quarter of the device's own otherwise)",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=1.0,
        help="with --search: the run's gradient clipping, as pc-train's (default 1.0; 0: none, "
        "which lets Gemini step in backward)",
    )
    parser.add_argument("--top", type=int, default=10, help="with --search: plans to print")
    parser.add_argument(
        "--trial",
        type=int,
        default=0,
        metavar="K",
        help="with --search: run the first K plans for a step on this machine's processes and "
        "print each one's measured peak per rank beside the prediction",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _device(args: argparse.Namespace) -> DeviceInfo:
    """The machine to estimate for: ``--gpu``'s datasheet or this one,
    with ``--device-memory-gib`` per rank if given."""
    if args.gpu is not None:
        device = gpu_device(args.gpu, args.precision)
    else:
        device = DeviceInfo.detect(args.world, args.precision)
    if args.device_memory_gib is not None:
        device = replace(device, memory_bytes=int(args.device_memory_gib * GiB))
    if args.host_memory_gib is not None:
        device = replace(device, host_memory_bytes=int(args.host_memory_gib * GiB))
    if args.nvme_offload_dir is not None:
        device = replace(device, disk_bandwidth=disk_bandwidth(args.nvme_offload_dir))
    return device


def _estimate_plugin(args: argparse.Namespace, shape: ModelShape, device: DeviceInfo) -> Estimate:
    """``--plugin``: that plugin's estimate, after its own rules accept the run."""
    layout = {f.name: getattr(args, f.name) for f in fields(LayoutOptions)}
    options = PluginOptions.parse(args.plugin, **layout)
    options.check(args.world, args.precision, shape.layers, heads=shape.heads)
    return estimate(
        shape, options, args.world, args.micro_batch, args.seq_len, args.precision, device
    )


def _print_estimate(args: argparse.Namespace, result: Estimate) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    **asdict(result),
                    "model_state_bytes": result.model_state_bytes,
                    "async_save_bytes": result.async_save_bytes,
                    "full_save_bytes": result.full_save_bytes,
                }
            )
        )
    else:
        print(_table([result]))


def _recommend(args: argparse.Namespace, shape: ModelShape, device: DeviceInfo) -> Recommendation:
    """No ``--plugin``: the recommendation, with every candidate's estimate."""
    if args.step_in_backward:  # the plugin's own refusals (fp16)
        PluginOptions(PluginKind.GEMINI, step_in_backward=True).check(args.world, args.precision)
    return recommend(
        shape,
        args.world,
        args.micro_batch,
        args.seq_len,
        args.precision,
        device,
        step_in_backward=args.step_in_backward,
    )


def _print_recommendation(
    args: argparse.Namespace,
    name: str,
    shape: ModelShape,
    device: DeviceInfo,
    choice: Recommendation,
) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    "recommended": choice.options.flags(),
                    "reasons": list(choice.reasons),
                    "estimates": [
                        {**asdict(e), "model_state_bytes": e.model_state_bytes}
                        for e in choice.estimates
                    ],
                },
                indent=2,
            )
        )
        return
    print(
        f"{name}: {shape.params:,} parameters, {args.world} rank(s), micro-batch "
        f"{args.micro_batch} x {args.seq_len}, {args.precision}, "
        f"{gib_text(device.memory_bytes)} per rank ({device.kind})\n"
    )
    print(_table(choice.estimates))
    print(f"\nrecommended: {choice.options.flags()}")
    for reason in choice.reasons:
        print(f"  - {reason}")


def _cluster(args: argparse.Namespace, device: DeviceInfo) -> Cluster:
    if args.nodes < 1 or args.world % args.nodes:
        raise ValueError(f"--nodes {args.nodes} must divide --world {args.world}.")
    gbps = args.inter_node_gbps
    if gbps is None:
        gbps = {"H100": 50.0, "H200": 50.0, "A100": 25.0}.get(args.gpu or "", 0.0)
    inter = gbps * 1e9 if gbps else device.bandwidth / 4
    return Cluster(args.nodes, args.world // args.nodes, device, inter)


def _search(
    args: argparse.Namespace, spec: ModelSpec, shape: ModelShape, device: DeviceInfo
) -> None:
    """``--search`` (and ``--trial``): the ranked plans [Note: the planner]."""
    cluster = _cluster(args, device)
    batch = args.global_batch or args.micro_batch * args.world
    plans = search(shape, cluster, batch, args.seq_len, args.precision, max_norm=args.clip_norm)
    if not plans:
        raise ValueError(
            f"no layout of {spec.name} fits {gib_text(0.9 * device.memory_bytes)} per rank on "
            f"{args.world} rank(s); add ranks, or a --gpu with more memory."
        )
    shown = plans[: max(args.top, args.trial)]
    trials: dict[int, Trial] = {}
    if args.trial:
        if args.gpu is not None:
            raise ValueError("--trial runs the plans on this machine: drop --gpu.")
        from pc_train.trial import run_trials

        ran = run_trials(spec, shown[: args.trial], args.world, args.nodes, args.seq_len,
                         args.precision)  # fmt: skip
        trials = dict(enumerate(ran))
    if args.json:
        print(json.dumps([
            {"flags": p.flags(), "micro_batch": p.micro_batch, "tokens_per_second":
             p.tokens_per_second, "device_bytes": p.estimate.device_bytes,
             **({"measured_bytes": trials[i].measured_bytes} if i in trials else {})}
            for i, p in enumerate(shown)
        ], indent=2))  # fmt: skip
        return
    print(
        f"{spec.name}: {shape.params:,} parameters, {args.nodes} node(s) x "
        f"{cluster.per_node} ranks, {batch} x {args.seq_len} tokens a step, {args.precision}, "
        f"{gib_text(device.memory_bytes)} per rank ({device.kind}); {len(plans)} plans fit\n"
    )
    head = "| # | tokens/s | step s | per rank | model states | activations |"
    head += " measured peak | predicted / measured |" if trials else ""
    print(head + " pc-train flags |")
    print("|---" * (head.count("|")) + "|")
    for i, plan in enumerate(shown):
        e = plan.estimate
        row = (
            f"| {i + 1} | {plan.tokens_per_second:,.0f} | {plan.step_seconds:.3g} | "
            f"{gib_text(e.device_bytes)} | {gib_text(e.model_state_bytes)} | "
            f"{gib_text(e.activation_bytes)} |"
        )
        if trials:
            trial = trials.get(i)
            row += f" {gib_text(trial.measured_bytes)} | {trial.ratio:.3f} |" if trial else " | |"
        print(f"{row} `{plan.flags()}` |")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.world < 1 or args.micro_batch < 1 or args.seq_len < 1:
            raise ValueError("--world, --micro-batch and --seq-len must be at least 1.")
        placed = args.offload_frac or args.cpu_offload or args.nvme_offload_fraction
        if placed and args.plugin is None:
            raise ValueError(
                "--offload-frac, --cpu-offload and --nvme-offload-fraction estimate one plugin: "
                "pass --plugin zero1, zero2 or gemini with them (--search places states itself)."
            )
        if args.optimizer_states != "fp32" and args.plugin is None:
            raise ValueError(
                f"--optimizer-states {args.optimizer_states} estimates one plugin: pass --plugin "
                "zero1, zero2 or gemini with it (--search narrows the moments itself where fp32 "
                "moments do not fit)."
            )
        spec = resolve_model(args.model, args.seq_len)
        device = _device(args)
        shape = model_shape(spec)
        if args.search or args.trial:
            _search(args, spec, shape, device)
            return
        if args.plugin is not None:
            _print_estimate(args, _estimate_plugin(args, shape, device))
            return
        choice = _recommend(args, shape, device)
    except ValueError as error:
        print(f"pc-estimate: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    _print_recommendation(args, spec.name, shape, device, choice)


if __name__ == "__main__":
    main()
