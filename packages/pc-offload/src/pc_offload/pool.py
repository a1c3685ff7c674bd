"""A bounded pool of (pinned) host buffers and an engine for asynchronous
copies between host and device.

[Note: pool]
Buffers are kept per size class (powers of two bytes, at least 4 KiB), so a
released buffer serves any later request of its class without touching the
allocator; pinning memory is slow (it maps and locks pages), so reuse is the
point. The pool never holds more than ``max_bytes`` in all, in use or free:
a request that would exceed it first frees idle buffers of other classes,
and then raises :class:`PoolExhaustedError` naming what is held. Host memory is
pinned only where pinning means something (CUDA is available); otherwise
buffers are ordinary host memory and ``pinned`` says so.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "CopyEngine",
    "PinnedPool",
    "PoolExhaustedError",
    "PoolStats",
    "Transfer",
    "pinned_empty",
]

_MIN_CLASS = 4096
_REGISTER_FROM = 1 << 20  # pinned_empty: smaller buffers use torch's allocator


class _Registered(bytearray):
    """A bytearray that weak references (and so a finaliser) can follow."""


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of exactly its size, for long-lived buffers.

    torch's pinned allocator rounds every request up to a power of two (up
    to twice the bytes: a 0.8 GB shard takes 1 GiB); this pins an ordinary
    allocation with ``cudaHostRegister`` instead and unregisters it when the
    memory is freed. Falls back to ``pin_memory=True`` where registration is
    not available, and to ordinary memory without CUDA. The caller must not
    free it while an asynchronous copy still reads or writes it."""
    if not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    register = getattr(cudart, "cudaHostRegister", None)
    if nbytes < _REGISTER_FROM or register is None:  # small: the rounding costs little
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # CUDA pins whole pages: register only pages that lie entirely inside
    # this buffer, so no other allocation shares one (a second registration
    # of a page fails and leaves an error behind in the CUDA runtime).
    page = mmap.PAGESIZE
    length = -(-nbytes // page) * page
    buffer = _Registered(length + page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    offset = -start % page
    status = register(start + offset, length, 0)
    if int(getattr(status, "value", status)) != 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # The tensor's storage keeps the buffer alive; the buffer's finaliser
    # runs after the last view is gone, before its memory is released.
    weakref.finalize(buffer, cudart.cudaHostUnregister, start + offset)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)


class PoolExhaustedError(MemoryError):
    """The pool would grow past its bound."""


@dataclass(frozen=True)
class PoolStats:
    """What the pool holds, in bytes."""

    max_bytes: int
    reserved_bytes: int  # allocated by the pool, in use or idle
    in_use_bytes: int
    peak_reserved_bytes: int
    allocations: int  # buffers ever allocated
    reuses: int  # requests served from an idle buffer
    pinned: bool


def _size_class(nbytes: int) -> int:
    return max(_MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


class PinnedPool:
    """Reusable host buffers, bounded by ``max_bytes`` [Note: pool].

    ``acquire(shape, dtype)`` returns a host tensor; ``release`` gives it
    back. ``pin=None`` pins when CUDA is available.
    """

    def __init__(self, max_bytes: int = 4 << 30, *, pin: bool | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}.")
        self.max_bytes = max_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA: pinned memory only matters for device copies.")
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_use: dict[int, int] = {}  # data_ptr -> size class
        self._reserved = 0
        self._peak = 0
        self._allocations = 0
        self._reuses = 0
        self._lock = threading.Lock()

    def acquire(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                raw = free.pop()
                self._reuses += 1
            else:
                self._make_room(size, nbytes)
                raw = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
                self._reserved += size
                self._peak = max(self._peak, self._reserved)
                self._allocations += 1
            self._in_use[raw.data_ptr()] = size
        return raw[:nbytes].view(dtype).view(shape)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a buffer this pool handed out and not yet got back."""
        with self._lock:
            return tensor.data_ptr() in self._in_use

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            size = self._in_use.pop(tensor.data_ptr(), None)
            if size is None:
                raise ValueError(
                    "release() got a tensor this pool did not hand out (or released twice); "
                    "pass the tensor acquire() returned."
                )
            raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())[:size]
            self._free.setdefault(size, []).append(raw)

    def _make_room(self, size: int, nbytes: int) -> None:
        if self._reserved + size <= self.max_bytes:
            return
        for other in sorted(self._free, reverse=True):  # drop idle buffers, largest first
            while self._free[other] and self._reserved + size > self.max_bytes:
                self._free[other].pop()
                self._reserved -= other
        if self._reserved + size > self.max_bytes:
            in_use = sum(self._in_use.values())
            raise PoolExhaustedError(
                f"pinned pool: a {nbytes}-byte request (a {size}-byte buffer) would exceed "
                f"max_bytes={self.max_bytes}; {in_use} bytes are in use. Release buffers "
                "sooner, or create the pool with a larger max_bytes."
            )

    def empty_cache(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            for size, free in self._free.items():
                self._reserved -= size * len(free)
            self._free.clear()

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                max_bytes=self.max_bytes,
                reserved_bytes=self._reserved,
                in_use_bytes=sum(self._in_use.values()),
                peak_reserved_bytes=self._peak,
                allocations=self._allocations,
                reuses=self._reuses,
                pinned=self.pinned,
            )


class Transfer:
    """A copy in flight. ``wait()`` returns the destination tensor ready for
    its user: a device destination orders the caller's current stream on
    that device after the copy; a host destination blocks the host until
    the copy has landed (host code reads it directly)."""

    def __init__(self, result: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.result = result
        self._event = event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            if self.result.is_cuda:
                stream = torch.cuda.current_stream(self.result.device)
                stream.wait_event(self._event)
                # Its memory may come from the copy stream's pool: not reused
                # before the consumer's work is done.
                self.result.record_stream(stream)
            else:
                self._event.synchronize()
        return self.result

    def is_completed(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        """Block the host until the copy is done."""
        if self._event is not None:
            self._event.synchronize()


class CopyEngine:
    """Moves tensors between device and host through a :class:`PinnedPool`.

    On CUDA each copy runs on a side stream, so it overlaps the caller's
    kernels. A copy to the host is ordered after the caller's current stream
    at the time of the call (the kernel that made the tensor), its source
    protected from reuse by ``record_stream``; a copy to the device is not
    (its source is ready on the host). On the CPU copies are immediate and
    the transfer is complete on return.
    """

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool if pool is not None else PinnedPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[tuple[Transfer, torch.Tensor]] = []

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if str(device) == "cuda":  # "cuda" and "cuda:0" must share one side stream
            device = torch.device(device.type, torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def _run(
        self,
        device: torch.device,
        copy: Callable[[], object],
        result: torch.Tensor,
        keep: torch.Tensor,
    ) -> Transfer:
        if device.type != "cuda":
            copy()
            return Transfer(result, None)
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            copy()
            keep.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return Transfer(result, event)

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Transfer:
        """Copy ``tensor`` into a pool buffer (release it with ``pool.release``),
        or into ``out``, a host tensor of the same shape and dtype that the
        caller keeps (long-lived buffers: pinned once, exactly sized)."""
        if out is None:
            host = self.pool.acquire(tensor.shape, tensor.dtype)
        elif out.device.type != "cpu" or out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"to_host(out=...) needs a host tensor of shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}; got {out.device} {tuple(out.shape)} {out.dtype}."
            )
        else:
            host = out
        return self._run(tensor.device, lambda: host.copy_(tensor, non_blocking=True), host, tensor)

    def to_device(self, host: torch.Tensor, device: torch.device) -> Transfer:
        """Copy a host tensor, ready on the host, to ``device`` (a fresh
        tensor there). On CUDA the copy does not wait for the caller's queued
        work: the destination comes from the side stream's own memory, so it
        overlaps everything queued before it; ``wait()`` orders the consumer
        after the copy and records the consumer's stream on the result."""
        if device.type != "cuda":
            out = torch.empty_like(host, device=device)
            out.copy_(host)
            return Transfer(out, None)
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            out = torch.empty_like(host, device=device)
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return Transfer(out, event)

    def release_after(self, transfer: Transfer, host: torch.Tensor) -> None:
        """Give ``host`` back to the pool once ``transfer`` (which reads or
        writes it) has finished; on the CPU, at once."""
        if transfer.is_completed():
            self.pool.release(host)
        else:
            self._pending.append((transfer, host))
        self._reap()

    def _reap(self) -> None:
        still = []
        for transfer, host in self._pending:
            if transfer.is_completed():
                self.pool.release(host)
            else:
                still.append((transfer, host))
        self._pending = still

    def synchronize(self) -> None:
        """Wait for every copy and release every buffer waiting on one."""
        for transfer, host in self._pending:
            transfer.synchronize()
            self.pool.release(host)
        self._pending = []
