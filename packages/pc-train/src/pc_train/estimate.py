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
from dataclasses import asdict, replace

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
from pc_train.hardware import GPUS, DeviceInfo, GiB, cpu_peak_flops, gpu_device, gpu_peak_flops
from pc_train.models import MODEL_PRESETS, resolve_model
from pc_train.options import PRECISIONS, PluginKind, PluginOptions

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
        "| plugin | params/rank | model states | of which host | activations | step (s) "
        "| fits | async save | full save |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for e in estimates:
        rows.append(
            f"| {e.plugin} | {e.params_per_rank:,} | {gib_text(e.model_state_bytes)} | "
            f"{gib_text(e.host_bytes)} | {gib_text(e.activation_bytes)} | {e.step_seconds:.3g} | "
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
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument(
        "--sp", type=int, default=1, help="sequence-parallel size (with --plugin hybrid)"
    )
    parser.add_argument(
        "--sp-mode",
        choices=("all_to_all", "ring_attn"),
        default="all_to_all",
        help="with --sp: all_to_all (Ulysses) or ring_attn (ring attention)",
    )
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (with --plugin hybrid, MoE models)"
    )
    parser.add_argument("--zero-stage", type=int, default=1)
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
        "--step-in-backward",
        action="store_true",
        help="Gemini stepping each chunk inside backward (12 bytes per parameter of model "
        "states instead of 16; training with --clip-norm 0 --accumulation 1): with --plugin "
        "gemini, estimate it; without --plugin, let the recommendation use it",
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
    return device


def _estimate_plugin(args: argparse.Namespace, shape: ModelShape, device: DeviceInfo) -> Estimate:
    """``--plugin``: that plugin's estimate, after its own rules accept the run."""
    options = PluginOptions.parse(
        args.plugin,
        tp=args.tp,
        pp=args.pp,
        zero_stage=args.zero_stage,
        sp=args.sp,
        sp_mode=args.sp_mode,
        ep=args.ep,
    )
    if args.step_in_backward:
        options = replace(options, step_in_backward=True)
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


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.world < 1 or args.micro_batch < 1 or args.seq_len < 1:
            raise ValueError("--world, --micro-batch and --seq-len must be at least 1.")
        spec = resolve_model(args.model, args.seq_len)
        device = _device(args)
        shape = model_shape(spec)
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
