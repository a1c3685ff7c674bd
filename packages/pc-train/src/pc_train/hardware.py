"""The hardware catalogue: what a machine offers a training run, for
pc-estimate's predictions and pc-train's MFU. :class:`DeviceInfo` is
memory, peak FLOP/s and collective bandwidth per rank, detected on this
machine or taken from the datasheet table of GPUs (``pc-estimate --gpu``);
a CPU's peak is measured (fp32 matrix products on the rank's threads)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "GPUS",
    "DeviceInfo",
    "GiB",
    "cpu_peak_flops",
    "disk_bandwidth",
    "gpu_device",
    "gpu_peak_flops",
    "peak_flops",
]

GiB = 2**30


@dataclass(frozen=True)
class DeviceInfo:
    """The machine the estimate is for: memory per rank, peak FLOP/s per
    rank, and the bus bandwidth of the data-parallel collectives;
    ``host_memory_bytes``: a GPU rank's share of the host's memory (None:
    not known, not checked; a CPU rank's device memory is its host
    memory); ``disk_bandwidth``: bytes/s to and from the NVMe tier's disk
    (:func:`disk_bandwidth` measures it; the default is a conservative
    NVMe's). The rest time a step's parts [Note: the step's time in
    pc_train.step_time]: ``ranks_per_core``, above 1 where a CPU's ranks
    outnumber its cores; ``block_seconds``, a transformer block's fixed
    cost per micro-batch; ``call_seconds``, a collective call's;
    ``memory_bandwidth``, what Adam's pass over the states runs at;
    ``int8_seconds_per_param``, 8-bit moments' quantisation."""

    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    peak_flops: float
    bandwidth: float  # bytes/s
    efficiency: float  # share of peak a training step reaches
    host_memory_bytes: int | None = None
    disk_bandwidth: float = 1e9
    ranks_per_core: float = 1.0
    block_seconds: float = 0.0
    call_seconds: float = 0.0
    memory_bandwidth: float = 1e11
    int8_seconds_per_param: float = 0.0

    @staticmethod
    def detect(local_ranks: int, precision: str = "fp32", *, fork_safe: bool = False) -> DeviceInfo:
        """This machine. ``fork_safe``: measure the CPU peak on one thread and
        scale it by the thread count, so this process never starts OpenMP's
        thread team (in a process that forks afterwards, GNU OpenMP hangs
        in the child) and never touches CUDA."""
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if not fork_safe and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            peak = gpu_peak_flops(props.name, precision)
            host = pages // max(1, local_ranks)
            return DeviceInfo(
                "cuda", props.total_memory, peak, 150e9, 0.45, host,
                call_seconds=NCCL_CALL_SECONDS, memory_bandwidth=HBM_BANDWIDTH,
            )  # fmt: skip
        cores = os.cpu_count() or 1
        threads = max(1, cores // max(1, local_ranks))
        peak = cpu_peak_flops(1) * threads if fork_safe else cpu_peak_flops(threads)
        return DeviceInfo(
            "cpu", pages // max(1, local_ranks), peak, 2e9, CPU_TIMES["efficiency"],
            ranks_per_core=max(1.0, local_ranks / cores),
            block_seconds=CPU_TIMES["block_seconds"], call_seconds=CPU_TIMES["call_seconds"],
            memory_bandwidth=10e9, int8_seconds_per_param=CPU_TIMES["int8_seconds_per_param"],
        )  # fmt: skip


# [Note: the step's time in pc_train.step_time]: fitted to the calibration
# table on this project's 2-core machine (tools/calibrate_estimate.py).
CPU_TIMES = {
    "efficiency": 0.46,
    "block_seconds": 2.86e-3,
    "call_seconds": 1.76e-3,
    "int8_seconds_per_param": 1.81e-7,
}
# A NCCL call's latency within a node; HBM for Adam's pass.
NCCL_CALL_SECONDS = 2e-5
HBM_BANDWIDTH = 2e12


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
        "cuda", _GPU_MEMORY_GIB[name] * GiB, gpu_peak_flops(name, precision), 150e9, 0.45,
        call_seconds=NCCL_CALL_SECONDS, memory_bandwidth=HBM_BANDWIDTH,
    )  # fmt: skip


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


# [Note: the disk's bandwidth]
# The NVMe tier reads every moment it holds once a step and writes it
# back (pc_offload [Note: the NVMe tier]), so a step with D bytes there
# moves 2 D through the disk. The bandwidth is measured once per
# filesystem (device number) by writing 64 MiB to a scratch file in the
# directory, syncing it, dropping it from the page cache and reading it
# back (the slower of the two counts), and cached in
# ``$XDG_CACHE_HOME/pc/disk-bandwidth.json`` (default ``~/.cache``): a
# second estimate for the same disk measures nothing.

_PROBE_BYTES = 64 * 2**20


def disk_bandwidth(directory: str | os.PathLike[str], *, cache: Path | None = None) -> float:
    """Bytes/s to and from the disk holding ``directory`` [Note: the
    disk's bandwidth]; ``cache``: the cache file (default under
    ``$XDG_CACHE_HOME/pc``)."""
    where = Path(directory)
    try:
        info = os.lstat(where)
    except FileNotFoundError:
        raise ValueError(f"--nvme-offload-dir {str(where)!r} does not exist: create it.") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ValueError(  # as the tier refuses it: nothing is written through a link
            f"--nvme-offload-dir {str(where)!r} is not a directory (a symbolic link or a file): "
            "name a real directory on a local disk."
        )
    key = str(info.st_dev)
    if cache is None:
        root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache = Path(root) / "pc" / "disk-bandwidth.json"
    known: dict[str, float] = {}
    try:
        loaded = json.loads(cache.read_text())
        if isinstance(loaded, dict):  # data, never code; anything else is remeasured
            known = {k: float(v) for k, v in loaded.items() if isinstance(v, int | float)}
    except (OSError, ValueError):
        pass
    if key in known and known[key] > 0:
        return known[key]
    measured = _measure(where)
    known[key] = measured
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f".{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(known))
        os.replace(partial, cache)
    except OSError:
        pass  # a cache that cannot be written only costs the next measurement
    return measured


def _measure(where: Path) -> float:
    block = os.urandom(2**20) * 4  # 4 MiB of incompressible bytes
    with tempfile.TemporaryFile(dir=where) as file:
        start = time.perf_counter()
        for _ in range(_PROBE_BYTES // len(block)):
            file.write(block)
        file.flush()
        os.fsync(file.fileno())
        wrote = time.perf_counter() - start
        os.posix_fadvise(file.fileno(), 0, _PROBE_BYTES, os.POSIX_FADV_DONTNEED)
        file.seek(0)
        start = time.perf_counter()
        while file.read(len(block)):
            pass
        read = time.perf_counter() - start
    return _PROBE_BYTES / max(wrote, read, 1e-6)
