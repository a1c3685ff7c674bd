"""Keep freed host memory mapped, so training on the CPU does not page-fault
its working set back in every step.

[Note: host allocator]
PyTorch's CPU tensors come from the C library's ``malloc``. glibc returns
memory to the kernel eagerly: a block over the *mmap threshold* (128 KiB,
raised as large blocks are freed, up to 32 MiB) is its own mapping, unmapped
when freed, and free memory at the top of the heap beyond the *trim
threshold* is given back after a ``free``. A training step allocates and
frees the same few hundred megabytes of activations and gradients every
step, so each step can fault them in again: 4 KiB at a time, each page
zeroed by the kernel. On the GPT-2 of the step benchmarks (23 M parameters,
batch 4x256, one thread per rank) that was 8,000 to 47,000 minor faults
per forward pass and 25,000 to 37,000 per backward, and a forward up to
10 % slower than with the memory kept. How many depends on the order of
allocations: pc's DDP, whose gradients live in its buckets, freed the fresh
gradients during backward and left the heap's top free to trim, which took
its forward from 8,000 to 38,000 faults.

:func:`tune_host_allocator` raises both thresholds with ``mallopt``, so
freed memory stays in the process for the next step and nothing is faulted
in twice. This is what the jemalloc or tcmalloc settings recommended for
PyTorch CPU training achieve (``LD_PRELOAD`` and never decaying dirty
pages), without preloading another allocator. The cost: the process keeps
its peak heap until it exits, which is wrong where memory, not speed, is
the limit: a run that places states on the host or the disk tier, or one
under a memory cap, needs what one phase freed for the next phase's
temporaries and the tier's page cache. :data:`RETURN_FREED` asks for the
opposite: every block over 1 MiB its own mapping, given back when freed,
and the heap trimmed past 1 MiB. ``pc-train`` keeps freed memory on every
rank of a CPU run except those (``cpu_offload``, ``offload_frac``,
``nvme_offload_fraction``, or ``PC_TRAIN_CGROUP``), which return it; the
benchmarks call it in every process, so every row, the single-process
baseline included, runs with the same setting.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

__all__ = ["RETURN_FREED", "HostAllocatorSettings", "tune_host_allocator"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes an int


@dataclass(frozen=True)
class HostAllocatorSettings:
    """What :func:`tune_host_allocator` asks glibc for, in bytes.

    ``mmap_threshold``: blocks at least this large get their own mapping
    (and are unmapped when freed); smaller ones come from the heap and are
    reused. ``trim_threshold``: free memory at the top of the heap kept
    before any is returned. ``top_pad``: extra bytes requested each time the
    heap grows.
    """

    mmap_threshold: int = 1 << 30
    trim_threshold: int = _INT_MAX
    top_pad: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("mmap_threshold", "trim_threshold", "top_pad"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= _INT_MAX:
                raise ValueError(
                    f"HostAllocatorSettings.{name} must be an int of bytes from 0 to "
                    f"{_INT_MAX} (mallopt takes a C int); got {value!r}."
                )


# Give freed memory back at once (see the module's note).
RETURN_FREED = HostAllocatorSettings(mmap_threshold=1 << 20, trim_threshold=1 << 20, top_pad=0)

_applied: HostAllocatorSettings | None = None


def tune_host_allocator(settings: HostAllocatorSettings | None = None) -> bool:
    """Ask glibc's ``malloc`` to keep freed memory mapped (see the module's
    note). Returns True when glibc took every setting, False where there is
    no glibc (macOS, Windows, musl) and nothing changed. Process-wide and
    idempotent; call it once, early, in each training process."""
    global _applied
    settings = settings or HostAllocatorSettings()
    if _applied == settings:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    # The process's own symbols: libc is loaded in every Python on glibc
    # (find_library would run ldconfig in a subprocess to find it).
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either fixes both (glibc stops
    # adjusting them itself), and a trim threshold alone under the default
    # 128 KiB mmap threshold would map and fault every block over 128 KiB.
    took = [
        mallopt(_M_MMAP_THRESHOLD, settings.mmap_threshold) == 1,
        mallopt(_M_TRIM_THRESHOLD, settings.trim_threshold) == 1,
        mallopt(_M_TOP_PAD, settings.top_pad) == 1,
    ]
    if all(took):
        _applied = settings
    return all(took)
