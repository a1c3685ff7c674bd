"""Collectives across the ranks of one host through shared memory.

[Note: segment lifetime]
Local rank 0 creates one file in /dev/shm, every rank maps it, and as soon as
all have mapped it (one barrier over the process group, at construction) rank
0 unlinks the name. From then on the memory belongs to the mappings alone:
it disappears when the last process that maps it exits, normally, by an
exception or by SIGKILL. Nothing can be left in /dev/shm after construction
returns; only a rank killed during construction itself can leave a name
behind. Such a name carries its creator's pid (``pc-comm-<pid>-<token>``),
and the next segment made on this host removes this user's names whose
creator is gone, so a crash's leftovers last until the next start, not for
ever. The file is created readable and writable by its owner only
(0600, whatever the umask): it holds gradients and parameters, and another
local user who opened it before the unlink could read them for the whole
run.

[Note: synchronisation without the store]
The hot path never touches the TCP store or a socket. The segment holds one
128-byte line per rank with a generation counter that only that rank writes.
``_barrier`` bumps this rank's counter, wakes whoever sleeps on it, and
waits until every counter reached the same generation: a few polls that
yield the core (none when the ranks outnumber the cores this process may
run on), then a
sleep in the kernel on the first missing rank's counter, which that rank's
wake ends at once [Note: waiting in the kernel, in pc_comm._futex]. Where
futexes do not exist the wait polls with naps of at most 1 ms. On x86-64
stores become visible in program order (TSO), so a counter
seen at generation g means the data its rank wrote before it is visible too.
Other architectures do not promise that, so there the barrier goes through
the process group instead (correct, slower). While waiting, the barrier
checks that the missing ranks' processes are alive, so a dead peer is named
at once; a live but stuck peer raises after ``timeout``.

[Note: one collective step]
Data moves in pieces of at most ``slot_bytes`` per rank; the segment holds
one input slot per rank and one shared result area. An all-reduce of a piece
moves as little as it can: each rank writes into its slot only the slices
that other ranks own (its own slice stays in the caller's tensor); barrier;
each rank reduces its own 1/L slice in place in the caller's tensor, adding
the peers' slot slices, and publishes it in the result area; barrier; each
rank copies the other slices of the result into its tensor. Every write to a
slot happens before a barrier that every read of it precedes, and the result
area is written only after the first barrier of the next piece, when all
ranks have finished reading it, so one set of buffers serves every call.

[Note: symmetric buffers]
``alloc`` (collective) maps one more segment holding L equal regions, one
per rank, and hands each rank a tensor over its own region. An all-reduce
of such a tensor needs no copy in and no result area: after a barrier, each
rank reduces its slice of every region and writes the result into that
slice of every region, block by block (256 KiB, so a block is still in the
cache when it is written out: one pass over memory instead of a reduction
pass and then every rank copying the other slices); a second barrier ends
the call, after which every region holds the whole result and a rank may
overwrite its region. Ranks touch disjoint slices, so nothing races. DDP
keeps its gradient buckets there.

[Note: matching calls]
With its first barrier, each operation publishes what it is (kind, element
count, detail) in the rank's control line, and checks the peers' after the
barrier: ranks that issue different collectives fail with an error naming
both calls instead of silently mixing data. Each line holds two signature
slots, used by odd and even barriers in turn. A rank can be at most one
barrier ahead of the slowest peer (it cannot pass barrier g+1 before every
peer arrived there, which a peer does only after reading the slots of
barrier g), so a slot is never rewritten while a peer may still read it, even
when a mismatch makes both ranks raise and go straight on to their next call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pc_comm import _futex, health
from pc_comm._host import HostExecutor
from pc_comm.communicator import (
    Handle,
    P2PKind,
    P2POp,
    ReduceOp,
    check_contiguous,
    divide_for_average,
)
from pc_comm.shm_p2p import P2PChannels

__all__ = ["ShmCommunicator", "ShmPeerError", "ShmSpaceError"]

_LINE = 128  # bytes per control line: two cache lines, so ranks never share one
_LINE_INT64 = _LINE // 8
_SPINS = 20  # yielding polls before a barrier sleeps, when every rank has a core
_CHECK_EVERY_S = 0.05  # how often a waiting barrier checks that its peers live
_TSO = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
_DEFAULT_SLOT_BYTES = 16 * 1024 * 1024
_P2P_SLOT_BYTES = 1024 * 1024  # per piece of a send; a pair's ring holds _P2P_SLOTS
_P2P_SLOTS = 4


class ShmPeerError(health.PeerFailureError):
    """A peer died or did not arrive at a shared-memory collective in time,
    or called a different one. With a health board (pc_comm.health), the
    message also says where every other rank is."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity; a cgroup CPU quota
    is not seen)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


def _remove_stale_segments() -> list[str]:
    """Remove this user's segment names whose creating process is gone
    (a rank killed while the group was being set up) [Note: segment
    lifetime]. Returns the names removed."""
    removed: list[str] = []
    for path in _shm_dir().glob("pc-comm-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its creator is gone: nothing maps it by name again
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except OSError:  # gone meanwhile, or a process of another user: alive
            continue
    return removed


def _shm_dir() -> Path:
    path = Path("/dev/shm")
    return path if path.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


_KINDS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_reduce(symmetric)",
    "reduce_scatter(symmetric)",
    "all_gather(symmetric)",
    "all_to_all",
)
_OPS = tuple(ReduceOp)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_Signature = tuple[int, int, int, int]


class ShmSpaceError(ValueError):
    """The shared-memory file system has no room for a segment [Note: room
    in /dev/shm]: a limit the user raises, not a failure to retry."""


# [Note: room in /dev/shm]
# A segment is a file in /dev/shm (tmpfs) sized with ftruncate: its pages
# are allocated only when first written, so a tmpfs too small for it
# (docker's default /dev/shm is 64 MiB) is found not at creation but at the
# first write past its end, by SIGBUS, which kills the rank without a word
# about /dev/shm. So before creating a segment that will be written through
# (a communicator's slots, a symmetric buffer), rank 0 checks that
# /dev/shm's free space holds it, and every rank raises ShmSpaceError
# naming the need, the space and the fix when it does not. The
# point-to-point rings, written only between the pairs that send, are not
# checked. Several segments that each fit but together do not still end in
# SIGBUS, which pc-train's launcher names with /dev/shm's space.


def _no_room(nbytes: int, world: int) -> str | None:
    """Why a segment of ``nbytes`` does not fit in the shared-memory
    directory now, or None when it does."""
    directory = _shm_dir()
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None  # nothing to measure: let the kernel decide
    free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    if nbytes <= free:
        return None
    mib = 2**20
    return (
        f"{directory} has {free / mib:.1f} MiB free of {total / mib:.1f} MiB; pc-comm's "
        f"shared-memory collectives need a segment of {nbytes / mib:.1f} MiB there for "
        f"{world} ranks (more for larger models and more ranks). Enlarge it (docker run "
        f"--shm-size=2g, or mount -o remount,size=2g {directory}) or free space there."
    )


def _signature(
    kind: str, count: int, dtype: torch.dtype, op: ReduceOp | None = None, extra: int = 0
) -> _Signature:
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    op_code = _OPS.index(op) + 1 if op is not None else 0
    return (_KINDS.index(kind) + 1, count, op_code * 64 + dtype_code, extra)


def _describe(line: Sequence[int]) -> str:
    kind, count, detail, extra = line[:4]
    if not 1 <= kind <= len(_KINDS):
        return "nothing yet"
    op_code, dtype_code = divmod(detail, 64)
    dtype = str(_DTYPES[dtype_code]) if dtype_code < len(_DTYPES) else "another dtype"
    parts = [f"count={count}", f"dtype={dtype.removeprefix('torch.')}"]
    if op_code:
        parts.append(f"op={_OPS[op_code - 1].value}")
    if extra:
        parts.append(f"at={extra}")
    return f"{_KINDS[kind - 1]}({', '.join(parts)})"


@dataclass(frozen=True)
class _Symmetric:
    """One segment of L equal regions, region r owned by rank r. Held by a
    weak reference: the segment lives as long as the tensors over it."""

    storage: weakref.ref[torch.UntypedStorage]
    region_bytes: int

    def region(self, rank: int) -> torch.Tensor:
        storage = self.storage()
        assert storage is not None, "a symmetric buffer was freed while in use"
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        return whole[rank * self.region_bytes : (rank + 1) * self.region_bytes]

    def views(self, world: int, offset: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """``count`` elements at byte ``offset`` of every rank's region."""
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        return [self.region(r)[offset : offset + nbytes].view(dtype) for r in range(world)]


# A symmetric all-reduce reduces and writes out this many bytes at a time
# [Note: symmetric buffers]: measured best of 64 KiB to 1 MiB on the 2-core
# development machine (2 MiB L2 per core), 4 ranks and 2.
_BLOCK_BYTES = 256 * 1024


def _reduce_into(
    acc: torch.Tensor, others: Sequence[torch.Tensor], op: ReduceOp, world: int
) -> None:
    """``acc = op(acc, *others)`` in place; AVG divides the sum by ``world``.
    Half-precision sums of more than two terms accumulate in fp32."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        if len(others) > 1 and acc.dtype in (torch.float16, torch.bfloat16):
            total = acc.float()
            for other in others:
                total.add_(other)
            acc.copy_(total)
        else:
            for other in others:
                acc.add_(other)
        if op is ReduceOp.AVG:
            divide_for_average(acc, world)
    elif op is ReduceOp.MAX:
        for other in others:
            torch.maximum(acc, other, out=acc)
    elif op is ReduceOp.MIN:
        for other in others:
            torch.minimum(acc, other, out=acc)
    elif op is ReduceOp.PRODUCT:
        for other in others:
            acc.mul_(other)
    else:
        raise TypeError(f"op must be a pc_comm.ReduceOp, got {op!r}.")


class ShmCommunicator(HostExecutor):
    """A :class:`~pc_comm.communicator.Communicator` over the ranks of one
    host, moving data through one shared-memory segment.

    ``group`` (default: the world) must contain only processes on this host;
    it is used only during construction and, on non-x86 machines, for
    barriers. ``slot_bytes`` bounds the piece each rank writes per step (the
    segment is ``(L + 1) * slot_bytes``); ``timeout`` bounds every wait
    (default: the default process group's timeout, as ``init_distributed``
    set it). A peer that dies (exits, is killed, or is a zombie not yet
    reaped) is noticed within 50 ms by any collective, send or receive
    waiting for it. Every operation runs on one worker thread in call order, so an
    ``async_op=True`` call overlaps the caller's computation. CUDA tensors are
    staged through pinned host memory on a side stream.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        slot_bytes: int = _DEFAULT_SLOT_BYTES,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ShmCommunicator needs an initialised process group for its setup; "
                "call pc_comm.init_distributed() first."
            )
        if slot_bytes < 1024 or slot_bytes % 64:
            raise ValueError(
                f"slot_bytes must be a multiple of 64, at least 1024; got {slot_bytes}."
            )
        world = dist.group.WORLD
        assert world is not None
        self.group: dist.ProcessGroup = group if group is not None else world
        self._rank = dist.get_rank(self.group)
        self._world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)
        # [Note: one timeout for every path], in pc_comm.health
        self._timeout_s = timeout.total_seconds() if timeout is not None else health.group_timeout()
        self.slot_bytes = slot_bytes
        self._check_same_host()

        control = self._world_size * _LINE
        self._segment = self._map_shared(control + (self._world_size + 1) * slot_bytes, "slots")
        # Control lines, int64 per rank: [generation, signature slot 0 (4),
        # signature slot 1 (4), unused].
        # Read and written through ctypes: a plain load or store per element
        # costs ~100 ns there against microseconds through torch indexing.
        # The array does not keep the mapping alive; self._segment does.
        self._control = (ctypes.c_int64 * (self._world_size * _LINE_INT64)).from_address(
            self._segment.data_ptr()
        )
        self._spins = 0 if self._world_size > usable_cores() else _SPINS
        self._use_futex = _futex.AVAILABLE
        self._data = self._segment[control:]
        self._generation = 0
        self._symmetric: list[_Symmetric] = []
        # Point-to-point rings, one per ordered pair [Note: point-to-point
        # through shared memory, in pc_comm.shm_p2p]. The file is sparse: a
        # pair's pages exist only once it sends. Mapped before the pid
        # exchange below, whose collective orders rank 0's unlink of its name
        # before any rank returns [Note: segment lifetime].
        self._p2p = P2PChannels(
            self._map_shared(
                P2PChannels.segment_bytes(self._world_size, _P2P_SLOT_BYTES, _P2P_SLOTS),
                "p2p",
                sparse=True,
            ),
            self._rank,
            self._world_size,
            _P2P_SLOT_BYTES,
            _P2P_SLOTS,
        )
        pids = [0] * self._world_size
        dist.all_gather_object(pids, os.getpid(), group=self.group)
        self._pids = pids
        self._p2p.watch(self._p2p_failure, _CHECK_EVERY_S)
        HostExecutor.__init__(self, "pc-shm-comm")

    def _check_same_host(self) -> None:
        hosts: list[str] = [""] * self._world_size
        dist.all_gather_object(hosts, platform.node(), group=self.group)
        if len(set(hosts)) != 1:
            raise ValueError(
                "ShmCommunicator needs every rank on one host; the group spans "
                f"{sorted(set(hosts))}. "
                "Use HierarchicalCommunicator across nodes."
            )

    def _map_shared(self, nbytes: int, kind: str, sparse: bool = False) -> torch.Tensor:
        """Collective: a segment of ``nbytes`` mapped by every rank, whose name
        is gone from the file system when this returns [Note: segment lifetime].
        Unless ``sparse`` (pages written only where used), the space for it
        must be free [Note: room in /dev/shm]. ``kind`` ends the name (slots,
        symmetric, p2p), so a count from outside can tell them apart."""
        names: list[str | None] = [None]
        if self._rank == 0:
            short = None if sparse else _no_room(nbytes, self._world_size)
            if short is not None:
                names = [f"!{short}"]
        if self._rank == 0 and names[0] is None:
            _remove_stale_segments()  # [Note: segment lifetime]
            created = str(_shm_dir() / f"pc-comm-{os.getpid()}-{uuid.uuid4().hex}-{kind}")
            # Readable by this user only [Note: segment lifetime]: the
            # segment holds training data (gradients, parameters).
            handle = os.open(created, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.fchmod(handle, 0o600)  # whatever the umask
                os.ftruncate(handle, nbytes)
            finally:
                os.close(handle)
            names = [created]
        dist.broadcast_object_list(names, group=self.group, group_src=0)
        path = names[0]
        assert path is not None
        if path.startswith("!"):  # rank 0 found no room: every rank says so
            raise ShmSpaceError(path[1:])
        try:
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            dist.barrier(group=self.group)  # every rank has mapped the file
        finally:
            if self._rank == 0 and os.path.exists(path):
                os.unlink(path)
        return segment

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a zero-filled 1-D tensor of ``numel`` elements in shared
        memory, one per rank at the same place [Note: symmetric buffers].
        All-reducing it, or any contiguous slice of it (the same slice on
        every rank), skips the copy into and out of the communicator's slots.
        Every rank must call ``alloc`` with the same arguments, in the same order."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}.")
        shape = [numel, dtype.itemsize, self._world_size]
        shapes: list[list[int] | None] = [None] * self._world_size
        dist.all_gather_object(shapes, shape, group=self.group)
        if any(other != shape for other in shapes):
            raise ValueError(
                "ShmCommunicator.alloc must be called with the same numel and dtype on "
                f"every rank; got [numel, itemsize, world] = {shapes}."
            )
        region = -(-max(1, numel * dtype.itemsize) // _LINE) * _LINE
        segment = self._map_shared(region * self._world_size, "symmetric")
        self._symmetric = [s for s in self._symmetric if s.storage() is not None]
        symmetric = _Symmetric(weakref.ref(segment.untyped_storage()), region)
        self._symmetric.append(symmetric)
        return symmetric.region(self._rank).view(dtype)[:numel]

    def _symmetric_of(self, tensor: torch.Tensor) -> tuple[_Symmetric, int] | None:
        """The symmetric buffer that holds ``tensor`` in this rank's region,
        and its byte offset there, or None."""
        if tensor.is_cuda or not self._symmetric:
            return None
        storage = tensor.untyped_storage()
        for symmetric in self._symmetric:
            if symmetric.storage() is storage:
                own = storage.data_ptr() + self._rank * symmetric.region_bytes
                start = tensor.data_ptr()
                end = start + tensor.numel() * tensor.element_size()
                if own <= start and end <= own + symmetric.region_bytes:
                    return symmetric, start - own
        return None

    def _symmetric_chunks(self, chunks: Sequence[torch.Tensor]) -> tuple[_Symmetric, int] | None:
        """When ``chunks`` are the consecutive equal slices of one tensor in
        this rank's region of a symmetric buffer: that buffer and the byte
        offset of the first slice."""
        first = self._symmetric_of(chunks[0])
        if first is None:
            return None
        nbytes = chunks[0].numel() * chunks[0].element_size()
        for r, chunk in enumerate(chunks):
            if chunk.numel() != chunks[0].numel() or not chunk.is_contiguous():
                return None
            if chunk.data_ptr() != chunks[0].data_ptr() + r * nbytes:
                return None
        if self._symmetric_of(chunks[-1]) is None:
            return None
        return first

    def __repr__(self) -> str:
        return f"ShmCommunicator(rank={self._rank}, world_size={self._world_size})"

    # -- synchronisation -------------------------------------------------

    def _barrier(self, what: str, signature: _Signature | None = None) -> None:
        """Wait until every rank got here. With a ``signature`` (kind, count,
        detail, offset), also check that every rank is in the same call [Note:
        matching calls]."""
        self._generation += 1
        generation = self._generation
        control, me = self._control, self._rank
        first = 1 + 4 * (generation % 2)
        if signature is not None:
            for i, value in enumerate(signature):
                control[me * _LINE_INT64 + first + i] = value
        if not _TSO:
            dist.barrier(group=self.group)
        else:
            control[me * _LINE_INT64] = generation  # after the signature (TSO)
            if _futex.AVAILABLE:
                _futex.wake(self._counter_address(me))  # peers may sleep on it
            self._wait_for(generation, what)
        if signature is not None:
            self._check_signatures(signature, what, first)

    def _counter_address(self, rank: int) -> int:
        return ctypes.addressof(self._control) + rank * _LINE

    def _wait_for(self, generation: int, what: str) -> None:
        """Until every rank's counter reached ``generation`` [Note:
        synchronisation without the store]."""
        control = self._control
        counters = range(0, self._world_size * _LINE_INT64, _LINE_INT64)
        deadline = time.monotonic() + self._timeout_s
        next_check = time.monotonic() + _CHECK_EVERY_S
        spins, nap = 0, 20e-6
        while True:
            missing = next((i for i in counters if control[i] < generation), None)
            if missing is None:
                return
            spins += 1
            if spins <= self._spins:
                os.sched_yield()
                continue
            if self._use_futex:
                seen = control[missing]
                if seen < generation:
                    try:
                        _futex.wait(self._counter_address(missing // _LINE_INT64), seen, 0.02)
                    except OSError:
                        self._use_futex = False  # nap from now on
            else:
                # Naps of at most 1 ms: a waiting rank shares its core with
                # the compute of its own process.
                time.sleep(nap)
                nap = min(nap * 1.5, 1e-3)
            if time.monotonic() > next_check:
                self._check_peers(generation, what, deadline)
                next_check = time.monotonic() + _CHECK_EVERY_S

    def _check_signatures(self, signature: _Signature, what: str, first: int) -> None:
        control = self._control
        lines = [
            [control[r * _LINE_INT64 + first + i] for i in range(4)]
            for r in range(self._world_size)
        ]
        if all(tuple(line) == signature for line in lines):
            return
        calls = ", ".join(f"rank {r}: {_describe(line)}" for r, line in enumerate(lines))
        raise ShmPeerError(
            f"ranks issued different collectives at shared-memory {what}: {calls}. "
            "Every rank must make the same calls, with the same sizes, in the same order.",
            what,
        )

    def _peer_error(self, cause: str, what: str, missing: list[int]) -> ShmPeerError:
        op = f"shared-memory {what}"
        report, _ = health.peers_report(self._global_ranks)
        return ShmPeerError(
            f"{health.headline(op, cause)} {report}", op, [self._global_ranks[r] for r in missing]
        )

    def _p2p_failure(self, peer: int, what: str, timed_out: float | None) -> Exception | None:
        """The error for a send or receive waiting on ``peer``: ShmPeerError
        when it died (exited, killed, or a zombie); TimeoutError, with the
        same report, when the wait's timeout passed (``timed_out``); None
        while neither."""
        if not health.process_alive(self._pids[peer]):
            return self._peer_error(
                f"rank {peer} (pid {self._pids[peer]}) died while rank {self._rank} waited for it",
                what,
                [peer],
            )
        if timed_out is not None:
            cause = f"not completed within {timed_out:g} s"
            return TimeoutError(str(self._peer_error(cause, what, [peer])))
        return None

    def _check_peers(self, generation: int, what: str, deadline: float) -> None:
        control = self._control
        missing = [r for r in range(self._world_size) if control[r * _LINE_INT64] < generation]
        for rank in missing:
            if not health.process_alive(self._pids[rank]):  # exited, killed, or a zombie
                raise self._peer_error(
                    f"rank {rank} (pid {self._pids[rank]}) died while rank {self._rank} "
                    "waited for it",
                    what,
                    [rank],
                )
        if time.monotonic() > deadline:
            raise self._peer_error(
                f"rank(s) {missing} did not reach it within {self._timeout_s:g} s",
                what,
                missing,
            )

    # -- buffers -----------------------------------------------------------

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The L input slots as a [L, slot_elems] tensor of ``dtype``."""
        slots = self._data[: self._world_size * self.slot_bytes]
        return slots.view(dtype).view(self._world_size, -1)

    def _result(self, dtype: torch.dtype) -> torch.Tensor:
        return self._data[self._world_size * self.slot_bytes :].view(dtype)

    def _piece(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // dtype.itemsize

    def _share(self, count: int, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s [lo, hi) of ``count`` elements, split as evenly as can be."""
        base, extra = divmod(count, self._world_size)
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (1 if rank < extra else 0)

    # -- host-side algorithms (run on the worker thread) -----------------------

    def _others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self._rank]

    def _host_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> None:
        """[Note: one collective step]"""
        found = self._symmetric_of(flat)
        if found is not None:
            self._symmetric_all_reduce(flat, op, *found)
            return
        slots, result = self._slots(flat.dtype), self._result(flat.dtype)
        piece = self._piece(flat.dtype)
        me, others = self._rank, self._others()
        signature = _signature("all_reduce", flat.numel(), flat.dtype, op)
        for start in range(0, flat.numel(), piece):
            count = min(piece, flat.numel() - start)
            x = flat[start : start + count]
            lo, hi = self._share(count, me)
            slots[me, :lo].copy_(x[:lo])
            slots[me, hi:count].copy_(x[hi:])
            self._barrier("all_reduce", signature if start == 0 else None)
            own = x[lo:hi]
            _reduce_into(own, [slots[r, lo:hi] for r in others], op, self._world_size)
            result[lo:hi].copy_(own)
            self._barrier("all_reduce")
            for r in others:
                r_lo, r_hi = self._share(count, r)
                x[r_lo:r_hi].copy_(result[r_lo:r_hi])

    def _symmetric_all_reduce(
        self, flat: torch.Tensor, op: ReduceOp, symmetric: _Symmetric, offset: int
    ) -> None:
        """[Note: symmetric buffers]"""
        count = flat.numel()
        regions = symmetric.views(self._world_size, offset, count, flat.dtype)
        me, others = self._rank, self._others()
        lo, hi = self._share(count, me)
        self._barrier(
            "all_reduce", _signature("all_reduce(symmetric)", count, flat.dtype, op, offset + 1)
        )
        mine, peers = flat[lo:hi], [regions[r][lo:hi] for r in others]
        block = max(1, _BLOCK_BYTES // flat.element_size())
        for start in range(0, hi - lo, block):
            acc = mine[start : start + block]
            _reduce_into(acc, [p[start : start + block] for p in peers], op, self._world_size)
            for p in peers:
                p[start : start + block].copy_(acc)
        self._barrier("all_reduce")

    def _host_reduce_scatter(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """``chunks[r]`` (all of one size) is reduced across ranks into rank r's ``out``."""
        found = self._symmetric_chunks(chunks)
        if found is not None:
            self._symmetric_reduce_scatter(out, chunks, op, *found)
            return
        slots = self._slots(out.dtype)
        size = chunks[0].numel()
        piece = max(1, self._piece(out.dtype) // self._world_size)
        signature = _signature("reduce_scatter", size, out.dtype, op)
        for start in range(0, size, piece):
            count = min(piece, size - start)
            mine = slots[self._rank, : self._world_size * count].view(self._world_size, count)
            for r, chunk in enumerate(chunks):
                if r != self._rank:
                    mine[r].copy_(chunk[start : start + count])
            self._barrier("reduce_scatter", signature if start == 0 else None)
            everyone = slots[:, : self._world_size * count].view(
                self._world_size, self._world_size, count
            )
            own = out[start : start + count]
            own.copy_(chunks[self._rank][start : start + count])
            peers = [everyone[r, self._rank] for r in self._others()]
            _reduce_into(own, peers, op, self._world_size)
            self._barrier("reduce_scatter")

    def _symmetric_reduce_scatter(
        self,
        out: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        op: ReduceOp,
        symmetric: _Symmetric,
        offset: int,
    ) -> None:
        """[Note: symmetric buffers] Each rank reduces its slice straight
        from every region: no copy in, two barriers."""
        size, dtype, world = chunks[0].numel(), chunks[0].dtype, self._world_size
        me, others = self._rank, self._others()
        regions = [v.view(world, size) for v in symmetric.views(world, offset, world * size, dtype)]
        signature = _signature("reduce_scatter(symmetric)", size, dtype, op, offset + 1)
        self._barrier("reduce_scatter", signature)
        if out.data_ptr() != chunks[me].data_ptr():
            out.copy_(chunks[me])
        _reduce_into(out, [regions[r][me] for r in others], op, self._world_size)
        self._barrier("reduce_scatter")  # peers are done reading this region

    def _symmetric_all_gather(
        self,
        outs: Sequence[torch.Tensor],
        inp: torch.Tensor,
        symmetric: _Symmetric,
        offset: int,
    ) -> None:
        """[Note: symmetric buffers] Each rank's slice is read straight
        from its owner's region: no copy through the slots."""
        size, dtype, world = inp.numel(), inp.dtype, self._world_size
        me, others = self._rank, self._others()
        regions = [v.view(world, size) for v in symmetric.views(world, offset, world * size, dtype)]
        if outs[me].data_ptr() != inp.data_ptr():
            outs[me].copy_(inp)
        self._barrier(
            "all_gather", _signature("all_gather(symmetric)", size, dtype, None, offset + 1)
        )
        for r in others:
            outs[r].copy_(regions[r][r])
        self._barrier("all_gather")  # peers are done reading this region

    def _host_all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[r]`` receives rank r's ``inp`` (sizes may differ by rank)."""
        if all(o.numel() == inp.numel() for o in outs):
            found = self._symmetric_chunks(outs)
            if found is not None:
                self._symmetric_all_gather(outs, inp.reshape(-1), *found)
                return
        slots = self._slots(inp.dtype)
        piece = self._piece(inp.dtype)
        longest = max(o.numel() for o in outs)
        signature = _signature("all_gather", longest, inp.dtype)
        for start in range(0, longest, piece):
            count = min(piece, max(0, inp.numel() - start))
            slots[self._rank, :count].copy_(inp[start : start + count])
            self._barrier("all_gather", signature if start == 0 else None)
            for r, out in enumerate(outs):
                n = min(piece, max(0, out.numel() - start))
                if r == self._rank:
                    out[start : start + n].copy_(inp[start : start + n])
                else:
                    out[start : start + n].copy_(slots[r, :n])
            self._barrier("all_gather")

    def all_to_all(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        async_op: bool = False,
    ) -> Handle:
        """``inputs[r]`` goes to rank ``r``, ``outputs[r]`` receives rank
        ``r``'s piece for this rank; pieces of any sizes, one dtype
        [Note: all-to-all through the slots]."""
        world = self._world_size
        if len(inputs) != world or len(outputs) != world:
            raise ValueError(
                f"all_to_all takes one input and one output per rank ({world}); got "
                f"{len(inputs)} inputs and {len(outputs)} outputs."
            )
        dtypes = {t.dtype for t in (*inputs, *outputs)}
        if len(dtypes) != 1:
            raise ValueError(f"all_to_all moves one dtype; got {sorted(map(str, dtypes))}.")
        for i, t in enumerate((*inputs, *outputs)):
            check_contiguous(t, f"all_to_all tensor {i}")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_all_to_all([o.view(-1) for o in outs], [t.view(-1) for t in ins])

        return self._run_staged(list(inputs), list(outputs), work, async_op, "all_to_all")

    def _host_all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """[Note: all-to-all through the slots]"""
        world, me = self._world_size, self._rank
        sizes = self._data[: world * self.slot_bytes].view(torch.int64).view(world, -1)
        mine = [t.numel() for t in ins] + [o.numel() for o in outs]
        sizes[me, : 2 * world].copy_(torch.tensor(mine, dtype=torch.int64))
        self._barrier("all_to_all", _signature("all_to_all", world, ins[0].dtype))
        table = sizes[:, :world].clone()  # table[r, d]: what rank r sends rank d
        held = sizes[:, world : 2 * world].clone()  # held[d, r]: rank d's output for r
        self._barrier("all_to_all")
        if not torch.equal(table, held.t()):  # every rank sees it, and every rank raises
            wrong = [d for d in range(world) if not torch.equal(table[:, d], held[d])]
            given = [held[d].tolist() for d in wrong]
            sent = [table[:, d].tolist() for d in wrong]
            raise ValueError(
                f"all_to_all: rank(s) {wrong} sized their outputs {given} where the ranks send "
                f"them {sent}; size each output as its sender's input for this rank."
            )
        step = self._piece(ins[0].dtype) // world  # elements per destination per round
        longest = int(table.max())
        slots = self._slots(ins[0].dtype)
        outs[me].copy_(ins[me])
        for start in range(0, longest, step):
            for d, piece in enumerate(ins):
                n = min(step, max(0, piece.numel() - start))
                if d != me and n:
                    slots[me, d * step : d * step + n].copy_(piece[start : start + n])
            self._barrier("all_to_all")
            for r, out in enumerate(outs):
                n = min(step, max(0, out.numel() - start))
                if r != me and n:
                    out[start : start + n].copy_(slots[r, me * step : me * step + n])
            self._barrier("all_to_all")

    def _host_broadcast(self, flat: torch.Tensor, src: int) -> None:
        slots = self._slots(flat.dtype)
        piece = self._piece(flat.dtype)
        signature = _signature("broadcast", flat.numel(), flat.dtype, extra=src + 1)
        for start in range(0, flat.numel(), piece):
            count = min(piece, flat.numel() - start)
            if self._rank == src:
                slots[src, :count].copy_(flat[start : start + count])
            self._barrier("broadcast", signature if start == 0 else None)
            if self._rank != src:
                flat[start : start + count].copy_(slots[src, :count])
            self._barrier("broadcast")

    # [Note: all-to-all through the slots]
    # Each rank first writes how much it sends every rank (int64) into its
    # slot; after a barrier every rank reads the whole table, checks that its
    # outputs are sized as its senders say, and knows the longest piece.
    # Then, in rounds, each rank's slot is cut in one part per destination:
    # rank r writes the next part of its piece for rank d at d's place, and
    # after a barrier rank d copies its part out of every other rank's slot.
    # A piece a rank keeps is copied directly. Two barriers a round; a round
    # moves slot_bytes / world bytes per pair.

    # -- the rest of the Communicator protocol ----------------------------

    def _post_p2p(self, kind: P2PKind, tensor: torch.Tensor, peer: int) -> Handle:
        if not 0 <= peer < self._world_size or peer == self._rank:
            raise ValueError(
                f"{kind.value} peer must be another rank in [0, {self._world_size}), got {peer} "
                f"(this rank is {self._rank})."
            )
        check_contiguous(tensor, f"{kind.value} tensor")
        if tensor.is_cuda:
            raise ValueError(
                "ShmCommunicator sends and receives host tensors; for CUDA tensors use "
                "TorchCommunicator (NCCL moves them device to device)."
            )
        if not _TSO:
            raise NotImplementedError(
                "shared-memory send/recv relies on x86-64 store ordering; on "
                f"{platform.machine()} use TorchCommunicator."
            )
        return self._p2p.post(kind, tensor, peer)

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Handle:
        handle = self._post_p2p(P2PKind.SEND, tensor, dst)
        if not async_op:
            handle.wait(self._timeout_s)
        return handle

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        handle = self._post_p2p(P2PKind.RECV, tensor, src)
        if not async_op:
            handle.wait(self._timeout_s)
        return handle

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        return [self._post_p2p(op.kind, op.tensor, op.peer) for op in ops]

    def close(self) -> None:
        """Stop the worker and point-to-point threads."""
        self._p2p.close()
        HostExecutor.close(self)

    def barrier(self) -> None:
        self._submit(lambda: self._barrier("barrier"), async_op=False)
