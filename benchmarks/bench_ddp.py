"""hfreduce-style shared memory against gloo, and pc DDP against torch DDP.

1. All-reduce bus bandwidth (2 (n-1)/n * bytes / time) of ShmCommunicator
   and of gloo through torch.distributed, 1 to 256 MB, side by side.
2. DDP step time on GPT-2 (6 layers, hidden 512, 8 heads, vocab 8192,
   sequence 256, batch 4 per rank, one thread per rank): pc's
   DistributedDataParallel (shared memory, overlapped buckets), torch DDP
   (gloo) and the same model in a single process.

``--quick`` (``nox -s bench_quick``): no bandwidth table, the DDP step
without the "in step" row, and one line: pc DDP over torch DDP, paired.

    python benchmarks/bench_ddp.py [--world-sizes 2 4] [--skip-ddp] [--quick]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    alternate,
    bus_bandwidth,
    pair_line,
    paired_ratios,
    print_step_table,
    rounds_against,
    step_gpt2,
    step_times,
)

from pc_comm import DistributedDataParallel, ReduceOp, ShmCommunicator
from pc_comm.testing import spawn

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
SIZES_MB = (1, 16, 64, 256)
OURS, PEER = "pc DDP (shm)", "torch DDP (gloo)"


def _bandwidth(out: str) -> None:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    shm = ShmCommunicator()
    rows = []
    for size_mb in SIZES_MB:
        buf = torch.randn(size_mb * 1024 * 1024 // 4)
        sym = shm.alloc(buf.numel())
        sym.copy_(buf)
        iters = 5 if size_mb <= 64 else 3
        fns: dict[str, Callable[[], None]] = {
            "pc shm": lambda b=buf: shm.all_reduce(b, ReduceOp.SUM).wait(),  # type: ignore[misc]
            "pc shm symmetric": lambda b=sym: shm.all_reduce(b, ReduceOp.SUM).wait(),  # type: ignore[misc]
            "gloo": lambda b=buf: dist.all_reduce(b),  # type: ignore[misc]
        }
        gbps = bus_bandwidth(fns, iters, size_mb)
        rows.append(
            {
                "world": world,
                "size_mb": size_mb,
                "pc_gbps": gbps["pc shm"],
                "sym_gbps": gbps["pc shm symmetric"],
                "gloo_gbps": gbps["gloo"],
                "speedup": gbps["pc shm"] / gbps["gloo"],
                "sym_speedup": gbps["pc shm symmetric"] / gbps["gloo"],
            }
        )
    shm.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def _step_fn(model: torch.nn.Module, seed: int) -> Callable[[], None]:
    batch = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    return step


def _ddp_steps(iters: int, out: str, quick: bool) -> None:
    """Samples alternate between the set-ups, so drift on a shared
    machine hits them alike. The single-process step runs on rank 0 alone
    while the other ranks sleep in a barrier; "2 processes, no
    communication" shows what sharing the machine costs before any gradient
    moves (memory bandwidth and caches are shared between cores); "in
    step" adds a barrier at the end of each step, so each sample is the
    slower rank's step, as in any synchronous data parallelism: the floor
    for DDP on this machine."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    ours = DistributedDataParallel(step_gpt2(), communicator=ShmCommunicator())
    peer = torch.nn.parallel.DistributedDataParallel(step_gpt2())
    alone = _step_fn(step_gpt2(), rank)

    def alone_in_step() -> None:
        alone()
        dist.barrier()  # the step ends when the slower rank's ends, as in DDP

    steps: dict[str, Callable[[], None]] = {
        "single process": alone if rank == 0 else lambda: None,
        "2 processes, no communication": alone,
        "2 processes, no communication, in step": alone_in_step,
        OURS: _step_fn(ours, rank),
        PEER: _step_fn(peer, rank),
    }
    if quick:
        del steps["2 processes, no communication, in step"]
    for fn in steps.values():
        fn()
    samples = alternate(steps, iters, sync=True)
    times, ratios = step_times(samples), paired_ratios(samples)
    vs_peer = rounds_against(samples, PEER)
    ours.reducer.stop()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "ratios": ratios, "vs_peer": vs_peer}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ddp-iters", "--iters", type=int, default=6)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--quick", action="store_true", help="pc DDP over torch DDP only")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.quick:
        out = RESULTS / "ddp_quick.json"
        spawn(_ddp_steps, 2, args=(args.ddp_iters, str(out), True), timeout=1800)
        found = json.loads(out.read_text())
        floor = found["ratios"]["2 processes, no communication"]
        print(f"DDP floor (2 processes, no communication / single process): {floor:.3f} paired")
        print(pair_line(OURS, PEER, found["vs_peer"][OURS], 1.0))
        return
    rows: list[dict[str, float]] = []
    for world in [] if args.skip_bandwidth else args.world_sizes:
        out = RESULTS / f"bandwidth_w{world}.json"
        spawn(_bandwidth, world, args=(str(out),), timeout=1200)
        rows += json.loads(out.read_text())
    print("\n## All-reduce bus bandwidth, fp32 on the CPU (GB/s)\n")
    print("| ranks | size | gloo | pc shm | pc / gloo | pc symmetric | symmetric / gloo |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['world']} | {row['size_mb']} MB | {row['gloo_gbps']:.2f} | "
            f"{row['pc_gbps']:.2f} | {row['speedup']:.2f}x | "
            f"{row['sym_gbps']:.2f} | {row['sym_speedup']:.2f}x |"
        )
    result: dict[str, object] = {"bandwidth": rows}
    if not args.skip_ddp:
        out = RESULTS / "ddp_step.json"
        spawn(_ddp_steps, 2, args=(args.ddp_iters, str(out), False), timeout=1800)
        found = json.loads(out.read_text())
        print_step_table(
            "DDP step, GPT-2 6x512, batch 4x256 per rank, 2 ranks, 1 thread each",
            found["times"],
            found["ratios"],
            (PEER, found["vs_peer"]),
        )
        print(pair_line(OURS, PEER, found["vs_peer"][OURS], 1.0))
        result["ddp"] = found
    (RESULTS / "bench_ddp.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
