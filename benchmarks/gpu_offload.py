"""GPU only: the step-time cost of activation CPU offload (``CPUOffload``) on
GPT-2 medium, at several offload ratios, side by side in one run.

GPT-2 medium (24 layers, hidden 1024, 16 heads, vocab 50257), sequence 1024,
bf16 autocast, fused AdamW on the device. Every ratio runs the same model;
the rows are sampled alternately so drift hits each alike. Reported per
ratio: the median step, its ratio to no offload, the bytes moved to the host
per step, and the peak device memory of a step.

Run on a GPU machine: ``python benchmarks/gpu_offload.py`` (not part of
``nox -s bench``, which runs on the CPU machine; ``nox -s bench_gpu`` runs it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from _common import alternate

from pc_comm.testing import tiny_gpt2
from pc_offload import CopyEngine, CPUOffload, PinnedPool


def _bandwidth(nbytes: int) -> tuple[float, float]:
    """Pinned host <-> device copy bandwidth, GB/s (to host, to device)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append(5 * nbytes / (time.perf_counter() - start) / 1e9)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    parser.add_argument("--pool-gib", type=float, default=48.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_offload.py needs a CUDA device.")
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = tiny_gpt2(
        50257, args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.heads
    ).to(device)
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    engine = CopyEngine(PinnedPool(int(args.pool_gib * (1 << 30))))
    ids = torch.randint(0, 50257, (args.batch, args.seq), device=device)
    stats: dict[float, tuple[int, int]] = {}

    def step(ratio: float) -> None:
        opt.zero_grad(set_to_none=True)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16),
            CPUOffload(offload_ratio=ratio, tag=f"r{ratio}", engine=engine) as offload,
        ):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        stats[ratio] = (offload.stats.offloaded_bytes, offload.stats.saved_bytes)

    for ratio in args.ratios:  # warm-up: pinned buffers, kernels, the ratio's calibration
        for _ in range(3):
            step(ratio)
    by_name = alternate({f"{r:g}": partial(step, r) for r in args.ratios}, args.iters)
    samples = {r: by_name[f"{r:g}"] for r in args.ratios}
    peaks = {}
    for ratio in args.ratios:
        torch.cuda.reset_peak_memory_stats()
        step(ratio)
        peaks[ratio] = torch.cuda.max_memory_allocated()
    to_host, to_device = _bandwidth(1 << 30)
    tokens = args.batch * args.seq
    print(
        f"\n## CPUOffload on GPT-2 {args.layers}x{args.width} ({params / 1e6:.0f}M parameters), "
        f"batch {args.batch}x{args.seq}, bf16 autocast, checkpointing "
        f"{'on' if args.checkpoint else 'off'}, {torch.cuda.get_device_name()}\n"
    )
    print(f"pinned copies: to host {to_host:.1f} GB/s, to device {to_device:.1f} GB/s\n")
    print("| offload_ratio | step (ms) | / ratio 0 | tokens/s | moved to host (GB) | "
          "saved (GB) | peak device memory (GB) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(samples[args.ratios[0]])
    for ratio in args.ratios:
        median = statistics.median(samples[ratio])
        moved, saved = stats[ratio]
        print(
            f"| {ratio:g} | {median * 1e3:.1f} | {median / base:.3f} | {tokens / median:,.0f} | "
            f"{moved / 1e9:.2f} | {saved / 1e9:.2f} | {peaks[ratio] / 1e9:.2f} |"
        )
    print(f"\npool: {engine.pool.stats()}")


if __name__ == "__main__":
    main()
