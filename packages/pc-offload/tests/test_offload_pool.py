"""PinnedPool reuses and bounds its buffers; CopyEngine moves tensors and
returns buffers only once their copies are done."""

from __future__ import annotations

import pytest
import torch

from pc_offload import CopyEngine, PinnedPool, PoolExhaustedError

pytestmark = pytest.mark.timeout(60)


def test_buffers_are_reused_by_size_class() -> None:
    pool = PinnedPool(1 << 20, pin=False)
    a = pool.acquire((100,), torch.float32)  # 400 B -> a 4 KiB buffer
    assert a.shape == (100,)
    assert a.dtype == torch.float32
    pointer = a.data_ptr()
    pool.release(a)
    b = pool.acquire((10, 30), torch.bfloat16)  # 600 B: the same class
    assert b.data_ptr() == pointer
    stats = pool.stats()
    assert (stats.allocations, stats.reuses) == (1, 1)
    assert stats.in_use_bytes == 4096
    assert not stats.pinned
    pool.release(b)
    assert pool.stats().in_use_bytes == 0


def test_the_bound_holds_and_idle_buffers_make_room() -> None:
    pool = PinnedPool(64 * 1024, pin=False)
    small = [pool.acquire((4096,), torch.float32) for _ in range(2)]  # 2 x 16 KiB
    for t in small:
        pool.release(t)
    big = pool.acquire((8192,), torch.float32)  # 32 KiB: fits beside the idle ones
    assert pool.stats().reserved_bytes == 64 * 1024
    other = pool.acquire((12_000,), torch.uint8)  # 16 KiB class: frees an idle buffer
    assert pool.stats().reserved_bytes <= 64 * 1024
    with pytest.raises(PoolExhaustedError, match=r"would exceed max_bytes=65536; 49152 bytes"):
        pool.acquire((16_000,), torch.float32)
    pool.release(big)
    pool.release(other)
    assert pool.stats().peak_reserved_bytes <= 64 * 1024


def test_releasing_a_foreign_tensor_is_an_error() -> None:
    pool = PinnedPool(1 << 20, pin=False)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(3))
    t = pool.acquire((3,), torch.float32)
    pool.release(t)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(t)


def test_pinning_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        PinnedPool(1 << 20, pin=True)
    assert not PinnedPool(1 << 20).pinned  # the default follows the machine


def test_copy_engine_round_trip() -> None:
    engine = CopyEngine(PinnedPool(1 << 20, pin=False))
    x = torch.randn(33, 7)
    down = engine.to_host(x)
    host = down.wait()
    assert torch.equal(host, x)
    assert host.data_ptr() != x.data_ptr()
    up = engine.to_device(host, torch.device("cpu"))
    assert torch.equal(up.wait(), x)
    assert up.is_completed()
    engine.release_after(up, host)
    engine.synchronize()
    assert engine.pool.stats().in_use_bytes == 0


def test_pinned_empty_registers_whole_pages_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registration logic, with CUDA's two calls recorded (the GPU test
    checks the real thing): exactly the bytes asked for, page-aligned,
    whole pages inside the buffer, unregistered once the last view is gone."""
    import gc
    import mmap

    from pc_offload import pinned_empty

    calls: list[tuple[str, int, int]] = []

    class FakeCudart:
        def cudaHostRegister(self, address: int, length: int, flags: int) -> int:  # noqa: N802
            calls.append(("register", address, length))
            return 0

        def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
            calls.append(("unregister", address, 0))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    shape = (3, 100_003)
    host = pinned_empty(shape, torch.float32)
    nbytes = 3 * 100_003 * 4
    assert host.shape == shape
    assert host.dtype == torch.float32
    assert host.untyped_storage().nbytes() >= nbytes
    ((kind, address, length),) = calls
    assert kind == "register"
    assert address == host.data_ptr()
    assert address % mmap.PAGESIZE == 0
    assert length % mmap.PAGESIZE == 0
    assert nbytes <= length < nbytes + mmap.PAGESIZE
    host.fill_(1.5)
    view = host[2]
    del host
    gc.collect()
    assert len(calls) == 1  # a view keeps the buffer registered
    assert torch.all(view == 1.5)
    del view
    gc.collect()
    assert calls[-1] == ("unregister", address, 0)
