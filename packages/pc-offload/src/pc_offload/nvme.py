"""A disk tier for optimizer states: moments (and separate masters) in
scratch files on local disk, mapped into memory.

[Note: the NVMe tier]
A tensor placed on the tier is a view of a private, memory-mapped scratch
file (``mmap`` of a file allocated in full up front), so everything that
reads or writes optimizer state (the fused step, checkpoints, ZeRO's and
Gemini's pieces) works on it unchanged; the pages live in the kernel's page
cache, which it writes to disk and reclaims under memory pressure instead of
failing (they are file pages, not anonymous memory: a cgroup's limit evicts
them). The step streams through them one tensor at a time: while a tensor
is stepped a reader thread reads the next one's range into the page cache
(``pread``, which lets go of the interpreter while the disk works), and
after it a writer thread writes its pages back and drops them from the
cache (``msync`` then ``POSIX_FADV_DONTNEED``), so what the tier holds in
memory between tensors is about the tensors in flight, not the whole
state. The step's first tensor is read during the forward and backward
before it (asked for at the end of the previous step, once its own
write-behind is done). The step waits on the disk only in ``ready`` (a
read not done when its tensor is stepped) and ``wait`` (a write-behind not
done when the next step starts); both are timed, with the bytes moved, in
``NvmeTier.stats`` (``benchmarks/bench_nvme.py`` prints them per step).
(A pinned-buffer
design with ``O_DIRECT`` reads, DeepSpeed's, avoids the page cache
entirely but needs every reader of the state to go through it; pc chose
the mapping so that checkpoints and sharded pieces need no second path.)

Scratch, never a checkpoint: each optimizer's file is made in a directory
of its own, ``pc-nvme-<pid>-<random>`` (mode 0700), inside the directory
the user named, which must be a real directory (not a symbolic link) owned
by this user, or a shared sticky one such as /tmp. The file is created
exclusively (0600, never through a link), then it and its directory are
removed at once: the open descriptor and the mappings keep its blocks, and
nothing is left to find while the process runs, or on disk when it ends,
however it ends (multiprocessing's children and pc-train's ranks leave
through ``os._exit``, which runs no clean-up). Each tensor's range is
allocated when it is placed (``posix_fallocate``: a disk too small fails
there, naming the directory and the bytes, rather than with SIGBUS
mid-step). A directory left by a process killed between the two steps is
removed when the next tier starts.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["NvmeSpaceError", "NvmeStats", "NvmeTier"]

_PREFIX = "pc-nvme-"
_READ_BLOCK = 4 << 20  # bytes per pread


@dataclass(frozen=True)
class NvmeStats:
    """What a tier moved and how long its user waited on the disk, since it
    was made (subtract two to get one step's)."""

    bytes_read: int
    bytes_written: int
    read_wait_s: float  # in ``ready``: a tensor stepped before its read was done
    write_wait_s: float  # in ``wait``: a write-behind not done when asked for


class NvmeSpaceError(OSError):
    """The disk named for the NVMe tier has no room for the states."""


def _check_parent(parent: Path) -> None:
    """A real directory this user owns, or a shared sticky one (/tmp)."""
    try:
        info = os.lstat(parent)
    except FileNotFoundError:
        raise ValueError(
            f"nvme_offload_dir={str(parent)!r} does not exist: create it (a directory on a "
            "local disk with room for the offloaded states), or pass another."
        ) from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(
            f"nvme_offload_dir={str(parent)!r} is a symbolic link (to {os.readlink(parent)!r}): "
            "pc writes its scratch files only in a directory named directly; pass the target."
        )
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"nvme_offload_dir={str(parent)!r} is not a directory.")
    shared = bool(info.st_mode & stat.S_ISVTX) and bool(info.st_mode & stat.S_IWOTH)
    if info.st_uid != os.getuid() and not shared:
        raise ValueError(
            f"nvme_offload_dir={str(parent)!r} belongs to another user (uid {info.st_uid}): "
            "pc keeps its scratch files in a directory of this user's, or in a shared sticky "
            "one such as /tmp; pass one of those."
        )


def remove_stale(parent: Path) -> list[str]:
    """Scratch directories of this user's processes that no longer exist."""
    removed = []
    for path in parent.glob(f"{_PREFIX}*-*"):
        pid = path.name[len(_PREFIX) :].split("-")[0]
        try:
            info = os.lstat(path)
            if not pid.isdigit() or info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        except OSError:
            continue
    return removed


def _release(pools: tuple[ThreadPoolExecutor, ...], fd: int) -> None:
    for pool in pools:
        pool.shutdown(wait=True)
    os.close(fd)  # the blocks go with the last mapping


class NvmeTier:
    """Tensors backed by a private scratch file in ``parent`` [Note: the
    NVMe tier]."""

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        base = Path(parent)
        _check_parent(base)
        remove_stale(base)
        self.parent = base
        self.path = base / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        os.mkdir(self.path, 0o700)
        os.chmod(self.path, 0o700)  # whatever the umask
        name = self.path / "states"
        # One file, unlinked at once: the open descriptor and the mappings
        # keep its blocks until this process lets go of them.
        self._fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        os.unlink(name)
        os.rmdir(self.path)
        self.bytes = 0  # allocated on disk
        # One writer thread (write-behind of the tensors just stepped) and
        # one reader (read-ahead of the next), so that each overlaps the other.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pc-nvme-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pc-nvme-read")
        # Each tensor's storage address -> (its mapping, offset in the file, bytes).
        self._maps: dict[int, tuple[mmap.mmap, int, int]] = {}
        self._pending: list[Future[None]] = []
        # Storage address -> its write-behind in flight, its read-ahead in flight.
        self._writing: dict[int, Future[None]] = {}
        self._reading: dict[int, Future[int]] = {}
        self._read = self._written = 0
        self._read_wait = self._write_wait = 0.0
        self._finalizer = weakref.finalize(self, _release, (self._reader, self._pool), self._fd)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor backed by a new range of the scratch file."""
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = max(1, numel * dtype.itemsize)
        grain = mmap.ALLOCATIONGRANULARITY
        offset = -(-self.bytes // grain) * grain
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.parent).free
            raise NvmeSpaceError(
                error.errno,
                f"the NVMe tier needs {nbytes:,} more bytes in {str(self.parent)!r} "
                f"({self.bytes:,} already placed there), and the disk has {free:,} free: "
                "free space there, pass another nvme_offload_dir, or a smaller "
                "nvme_offload_fraction",
            ) from None
        mapped = mmap.mmap(self._fd, nbytes, offset=offset)
        self.bytes = offset + nbytes
        tensor = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
        tensor = tensor[: numel * dtype.itemsize].view(dtype).view(shape)
        self._maps[tensor.untyped_storage().data_ptr()] = (mapped, offset, nbytes)
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._maps

    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Read these tensors' ranges into memory on the reader thread (after
        their own write-behind, if one is in flight)."""
        for tensor in tensors:
            key = tensor.untyped_storage().data_ptr()
            found = self._maps.get(key)
            if found is None or key in self._reading:
                continue
            _, offset, nbytes = found
            writing = self._writing.get(key)
            self._reading[key] = self._reader.submit(_read_in, self._fd, offset, nbytes, writing)

    def ready(self, tensors: list[torch.Tensor]) -> None:
        """Until these tensors' reads are done (started now if they were not
        asked for): the time the step waits on the disk for them."""
        self.read_ahead(tensors)
        start = time.perf_counter()
        for tensor in tensors:
            future = self._reading.pop(tensor.untyped_storage().data_ptr(), None)
            if future is not None:
                self._read += future.result()
        self._read_wait += time.perf_counter() - start

    def write_behind(self, tensors: list[torch.Tensor]) -> None:
        """Write these tensors' pages back and drop them from memory, on the
        writer thread."""
        keys = [t.untyped_storage().data_ptr() for t in tensors]
        maps = [self._maps[key] for key in keys if key in self._maps]
        if maps:
            self._pending = [f for f in self._pending if not f.done()]
            future = self._pool.submit(_write_back, self._fd, maps)
            self._pending.append(future)
            self._written += sum(nbytes for _, _, nbytes in maps)
            self._writing = {k: f for k, f in self._writing.items() if not f.done()}
            self._writing.update((key, future) for key in keys if key in self._maps)

    def wait(self) -> None:
        """Until every write-behind finished (raising its error)."""
        pending, self._pending = self._pending, []
        start = time.perf_counter()
        try:
            for future in pending:
                future.result()
        finally:
            self._write_wait += time.perf_counter() - start

    def stats(self) -> NvmeStats:
        return NvmeStats(self._read, self._written, self._read_wait, self._write_wait)

    def close(self) -> None:
        self._finalizer()


def _write_back(fd: int, maps: list[tuple[mmap.mmap, int, int]]) -> None:
    for mapped, offset, nbytes in maps:
        mapped.flush(0, nbytes)  # msync: the pages reach the disk
        mapped.madvise(mmap.MADV_DONTNEED, 0, nbytes)  # this process lets go of them
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)  # and the page cache


def _read_in(fd: int, offset: int, nbytes: int, after: Future[None] | None) -> int:
    """Reads a range into the page cache, where the mapping finds it."""
    if after is not None:
        # Its pages reach the disk before they are read; its error, if any,
        # is raised to the step by ``wait``.
        with contextlib.suppress(BaseException):
            after.result()
    block = bytearray(min(nbytes, _READ_BLOCK))
    done = 0
    while done < nbytes:
        view = memoryview(block)[: min(len(block), nbytes - done)]
        got = os.preadv(fd, [view], offset + done)
        if got <= 0:
            break
        done += got
    return done
