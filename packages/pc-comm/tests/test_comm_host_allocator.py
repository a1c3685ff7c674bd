"""tune_host_allocator: settings are checked, glibc takes them, and a
training-like loop stops faulting freed memory back in."""

from __future__ import annotations

import platform
import resource
from pathlib import Path

import pytest
import torch

from pc_comm import HostAllocatorSettings, tune_host_allocator
from pc_comm.testing import spawn

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


@pytest.mark.parametrize("field", ["mmap_threshold", "trim_threshold", "top_pad"])
@pytest.mark.parametrize("value", [-1, 2**31, 1.5])
def test_settings_reject_what_mallopt_cannot_take(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"HostAllocatorSettings.{field} must be an int"):
        HostAllocatorSettings(**{field: value})  # type: ignore[arg-type]


def _faults_per_step(tune: bool) -> float:
    """Minor page faults per step of a loop that allocates and frees
    activations and gradients of 40 MB each, the way a training step does
    (elementwise, so a step takes milliseconds)."""
    if tune:
        assert tune_host_allocator()
        assert tune_host_allocator()  # idempotent
    torch.manual_seed(0)
    n = 10_000_000
    scale, shift = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n))
    x = torch.randn(n)
    counts = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        scale.grad = shift.grad = None
        ((x * scale).tanh() * shift).sum().backward()  # type: ignore[no-untyped-call]
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The quietest step once the heap has grown: with glibc's defaults every
    # step maps its blocks afresh; tuned, a step reuses them (a few still
    # fault now and then, when small allocations have split a freed block).
    return min(counts[4:])


def _both_ranks(value: float, out: str) -> None:
    """Rank 0 writes both ranks' ``value``, rank 0's first."""
    import torch.distributed as dist

    gathered: list[float] = [0.0, 0.0]
    dist.all_gather_object(gathered, value)
    if dist.get_rank() == 0:
        Path(out).write_text(f"{gathered[0]} {gathered[1]}")


def _compare(out: str) -> None:
    # Two fresh processes (the harness spawns them), one tuned: glibc's
    # settings are process-wide and cannot be undone inside one.
    import torch.distributed as dist

    _both_ranks(_faults_per_step(tune=dist.get_rank() == 1), out)


@glibc
@pytest.mark.timeout(120)
def test_tuned_allocator_keeps_freed_memory(tmp_path: Path) -> None:
    out = tmp_path / "faults.txt"
    spawn(_compare, 2, args=(str(out),), timeout=100)
    default, tuned = map(float, out.read_text().split())
    # Every 40 MB block is over glibc's largest automatic mmap threshold
    # (32 MiB), so with its defaults each is mapped and faulted in anew (about
    # 10,000 pages each, five or more a step: 68,362 seen here); tuned, the
    # heap reuses them (0 to 1 seen here).
    assert default > 20_000, f"glibc's defaults no longer fault ({default}/step): retire this"
    assert tuned < default / 20, (default, tuned)


def _kept_after_free(keep: bool) -> int:
    """Anonymous resident bytes still held after 160 MB of 8 MB tensors
    (under glibc's automatic mmap threshold) are made and freed."""
    from pc_comm import RETURN_FREED

    assert tune_host_allocator(None if keep else RETURN_FREED)

    def anon() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    before = anon()
    blocks = [torch.ones(2_000_000) for _ in range(20)]
    del blocks
    return anon() - before


def _compare_kept(out: str) -> None:
    import torch.distributed as dist

    _both_ranks(_kept_after_free(keep=dist.get_rank() == 0), out)


@glibc
@pytest.mark.timeout(120)
def test_return_freed_gives_memory_back_that_the_default_tuning_keeps(tmp_path: Path) -> None:
    """What pc-train asks for where memory is the limit (states on the host
    or the disk tier, a memory cap) [Note: host allocator]."""
    out = tmp_path / "kept.txt"
    spawn(_compare_kept, 2, args=(str(out),), timeout=100)
    kept, returned = map(float, out.read_text().split())
    assert kept > 120_000_000, kept  # the heap keeps what it grew to
    assert returned < 8_000_000, returned  # each block was its own mapping, unmapped
