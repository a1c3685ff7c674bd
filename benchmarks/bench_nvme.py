"""The NVMe tier's step against states in memory, paired, with the disk's
bandwidth measured first ([Note: the NVMe tier] in pc_offload.nvme).

pc_offload.CPUAdamW over 24 tensors of 1 M fp32 parameters (24 M
parameters: 192 MiB of moments), one process, the intra-op threads of the
machine. Rows, sampled alternately round by round: moments in memory;
moments on the disk tier (``nvme_offload_fraction=1.0``) in a directory on
the benchmark's disk. Printed: the disk's sequential write and read
bandwidth (a 256 MiB file, written with fsync, read back after dropping it
from the page cache), each row's median step, the tier over memory paired,
and the bytes per step the tier moved (read and written back), against what
the disk sustains, and the time each step waited on the disk (reads not
done when their tensor was stepped, write-behind not done when the next
step began: ``NvmeTier.stats``). ``--compute-s`` puts a stand-in forward
and backward (matmuls of that many seconds) before each step, which the
write-behind and the first tensor's read overlap.

    python benchmarks/bench_nvme.py [--iters 8] [--dir /tmp] [--compute-s 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pc_offload import CPUAdamW

TENSORS, NUMEL = 24, 1 << 20


def disk_bandwidth(folder: Path, nbytes: int = 256 << 20) -> tuple[float, float]:
    """Sequential write (fsync) and cold read bandwidth, bytes per second."""
    path = folder / "pc-bench-disk"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(path, "wb") as out:
        for _ in range(nbytes >> 20):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    write = nbytes / (time.perf_counter() - start)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        while os.read(fd, 1 << 22):
            pass
        read = nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return write, read


def _optimizer(folder: Path | None) -> tuple[list[torch.nn.Parameter], CPUAdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn(NUMEL)
    fraction = 1.0 if folder is not None else 0.0
    opt = CPUAdamW(params, lr=1e-3, nvme_offload_fraction=fraction,
                   nvme_offload_dir=str(folder) if folder else None)  # fmt: skip
    opt.step()  # states made (and placed)
    return params, opt


def _compute(seconds: float) -> Callable[[], None]:
    """A stand-in forward and backward: matmuls that take about ``seconds``."""
    a = torch.randn(512, 512)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ a
        count += 1
    per = 0.2 / count
    repeats = round(seconds / per)

    def run() -> None:
        for _ in range(repeats):
            a @ a

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument(
        "--compute-s",
        type=float,
        default=0.0,
        help="seconds of stand-in forward and backward before each step",
    )
    args, _ = parser.parse_known_args()
    folder = Path(args.dir)
    write, read = disk_bandwidth(folder)
    mib = 2**20
    print(
        f"disk at {folder}: write {write / mib:.0f} MiB/s (fsync), cold read {read / mib:.0f} MiB/s"
    )
    compute = _compute(args.compute_s)
    rows = {"in memory": _optimizer(None)[1], "NVMe tier": _optimizer(folder)[1]}
    samples: dict[str, list[float]] = {name: [] for name in rows}
    waits: list[tuple[float, float]] = []  # the tier's read and write waits per step
    for i in range(args.iters):
        order = list(rows) if i % 2 == 0 else list(reversed(rows))
        for name in order:
            opt = rows[name]
            before = opt.nvme.stats() if opt.nvme is not None else None
            start = time.perf_counter()
            compute()
            opt.step()
            if opt.nvme is not None and args.compute_s == 0.0:
                opt.nvme.wait()  # no compute to hide it: the write-behind counts here
            samples[name].append(time.perf_counter() - start)
            if opt.nvme is not None and before is not None:
                after = opt.nvme.stats()
                waits.append(
                    (
                        after.read_wait_s - before.read_wait_s,
                        after.write_wait_s - before.write_wait_s,
                    )
                )
    moved = 2 * 2 * TENSORS * NUMEL * 4  # both moments, read and written back
    for name, values in samples.items():
        print(f"{name:10s} step {statistics.median(values) * 1e3:8.1f} ms")
    ratios = [d / m for d, m in zip(samples["NVMe tier"], samples["in memory"], strict=True)]
    print(
        f"NVMe tier / in memory: {statistics.median(ratios):.2f} paired "
        f"({len(ratios)} rounds, {min(ratios):.2f}-{max(ratios):.2f}); "
        f"{moved / 2**20:.0f} MiB moved per step, which the disk's bandwidth alone takes "
        f"{(moved / 2) / read + (moved / 2) / write:.2f} s"
    )
    reads = statistics.median(w[0] for w in waits) * 1e3
    writes = statistics.median(w[1] for w in waits) * 1e3
    print(
        f"waiting on the disk per step (median): reads {reads:.1f} ms, write-behind {writes:.1f} ms"
    )


if __name__ == "__main__":
    main()
