"""GPU only: all-reduce of CUDA tensors through the host, ours against gloo.

ShmCommunicator stages a CUDA tensor through pinned host memory on a side
stream (device -> host, shared-memory reduction, host -> device); gloo
through torch.distributed does its own staging. Ranks share the machine's
GPUs (two ranks may share one). Bus bandwidth 2 (n-1)/n * bytes / time,
the slowest rank's median, rows sampled alternately.

    python benchmarks/gpu_staging.py [--world-sizes 2 4]

Not part of ``nox -s bench`` (CPU machine); ``nox -s bench_gpu`` runs it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import bus_bandwidth

from pc_comm import ReduceOp, ShmCommunicator
from pc_comm.testing import spawn

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
SIZES_MB = (1, 16, 64, 256)


def _staged(out: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    shm = ShmCommunicator()
    rows = []
    for size_mb in SIZES_MB:
        buf = torch.randn(size_mb * 1024 * 1024 // 4, device=device)

        def ours(b: torch.Tensor = buf) -> None:
            shm.all_reduce(b, ReduceOp.SUM).wait()
            torch.cuda.synchronize(device)

        def gloo(b: torch.Tensor = buf) -> None:
            dist.all_reduce(b)
            torch.cuda.synchronize(device)

        fns: dict[str, Callable[[], None]] = {"pc shm": ours, "gloo": gloo}
        gbps = bus_bandwidth(fns, 5, size_mb)
        rows.append(
            {
                "world": world,
                "size_mb": size_mb,
                "pc_gbps": gbps["pc shm"],
                "gloo_gbps": gbps["gloo"],
                "speedup": gbps["pc shm"] / gbps["gloo"],
            }
        )
    shm.close()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_staging.py needs a CUDA device.")
    RESULTS.mkdir(exist_ok=True)
    rows: list[dict[str, float]] = []
    for world in args.world_sizes:
        out = RESULTS / f"gpu_staging_w{world}.json"
        spawn(_staged, world, args=(str(out),), timeout=900)
        rows += json.loads(out.read_text())
    print(f"\n## All-reduce of CUDA tensors through the host, {torch.cuda.get_device_name()}\n")
    print("| ranks | size | gloo (GB/s) | pc shm staged (GB/s) | pc / gloo |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['world']} | {row['size_mb']} MB | {row['gloo_gbps']:.2f} | "
            f"{row['pc_gbps']:.2f} | {row['speedup']:.2f}x |"
        )


if __name__ == "__main__":
    main()
