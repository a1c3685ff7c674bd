"""The hardware catalogue: what a machine offers a training run, for
pc-estimate's predictions and pc-train's MFU. :class:`DeviceInfo` is
memory, peak FLOP/s and collective bandwidth per rank, detected on this
machine or taken from the datasheet table of GPUs (``pc-estimate --gpu``);
a CPU's peak is measured (fp32 matrix products on the rank's threads)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

__all__ = [
    "GPUS",
    "DeviceInfo",
    "GiB",
    "cpu_peak_flops",
    "gpu_device",
    "gpu_peak_flops",
    "peak_flops",
]

GiB = 2**30


@dataclass(frozen=True)
class DeviceInfo:
    """The machine the estimate is for: memory per rank, peak FLOP/s per
    rank, and the bus bandwidth of the data-parallel collectives."""

    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    peak_flops: float
    bandwidth: float  # bytes/s
    efficiency: float  # share of peak a training step reaches

    @staticmethod
    def detect(local_ranks: int, precision: str = "fp32", *, fork_safe: bool = False) -> DeviceInfo:
        """This machine. ``fork_safe``: measure the CPU peak on one thread and
        scale it by the thread count, so this process never starts OpenMP's
        thread team (in a process that forks afterwards, GNU OpenMP hangs
        in the child) and never touches CUDA."""
        if not fork_safe and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return DeviceInfo(
                "cuda", props.total_memory, gpu_peak_flops(props.name, precision), 150e9, 0.45
            )
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
        peak = cpu_peak_flops(1) * threads if fork_safe else cpu_peak_flops(threads)
        return DeviceInfo("cpu", pages // max(1, local_ranks), peak, 2e9, 0.5)


_GPU_PEAKS = {  # dense tensor-core TFLOP/s: (bf16/fp16, fp32 via tf32)
    "H200": (989.0, 494.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10": (125.0, 62.5),
    "V100": (125.0, 15.7),
}
_GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "A10": 24, "V100": 32}
GPUS = tuple(_GPU_PEAKS)


def gpu_device(name: str, precision: str) -> DeviceInfo:
    """A GPU from the datasheet table (``pc-estimate --gpu H100``), for
    estimates made away from the machine; NVLink-class bandwidth."""
    return DeviceInfo(
        "cuda", _GPU_MEMORY_GIB[name] * GiB, gpu_peak_flops(name, precision), 150e9, 0.45
    )


def gpu_peak_flops(name: str, precision: str) -> float:
    for key, (half, single) in _GPU_PEAKS.items():
        if key in name:
            return (half if precision != "fp32" else single) * 1e12
    return 100e12


def cpu_peak_flops(threads: int) -> float:
    """Measured: fp32 matrix products on ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(512, 512)
        torch.mm(a, a)
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            torch.mm(a, a)
            count += 1
        return 2 * 512**3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)


def peak_flops(device: torch.device, local_ranks: int, precision: str) -> tuple[float, str]:
    """The MFU's denominator per rank: the GPU's datasheet, or a CPU
    matmul measured on the threads this rank trains with (the FLOP count
    is per rank, so the peak must be too)."""
    if device.type == "cuda":
        return DeviceInfo.detect(local_ranks, precision).peak_flops, "datasheet"
    threads = torch.get_num_threads()
    return cpu_peak_flops(threads), f"measured matmul, {threads} thread(s) per rank"
