"""Collectives across the ranks of one host through shared memory.

[Note: segment lifetime]
Local rank 0 creates one file in /dev/shm, every rank maps it, and as soon as
all have mapped it (one barrier over the process group, at construction) rank
0 unlinks the name. From then on the memory belongs to the mappings alone:
it disappears when the last process that maps it exits, normally, by an
exception or by SIGKILL. Nothing can be left in /dev/shm after construction
returns; only a rank killed during construction itself can leave a name
behind.

[Note: synchronisation without the store]
The hot path never touches the TCP store or a socket. The segment holds one
64-byte line per rank with a generation counter that only that rank writes.
``_barrier`` bumps this rank's counter and polls until every counter reached
the same generation, yielding the core between polls (ranks often outnumber
cores). On x86-64 stores become visible in program order (TSO), so a counter
seen at generation g means the data its rank wrote before it is visible too.
Other architectures do not promise that, so there the barrier goes through
the process group instead (correct, slower). While waiting, the barrier
checks that the missing ranks' processes are alive, so a dead peer is named
at once; a live but stuck peer raises after ``timeout``.

[Note: one collective step]
Data moves in pieces of at most ``slot_bytes`` per rank. For each piece:
every rank writes its input into its own slot; barrier; each rank computes
its share (reduces its 1/L slice of all slots, or reads what it needs);
barrier; ranks read the result. The second barrier guarantees nobody
overwrites a slot or the result area while a peer still reads it, so one set
of buffers serves every call: no allocation per call.
"""

from __future__ import annotations

import os
import platform
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pc_comm.communicator import (
    Handle,
    P2POp,
    ReduceOp,
    check_all_gather,
    check_all_gather_list,
    check_contiguous,
    check_reduce_op,
    check_reduce_scatter,
    check_reduce_scatter_list,
)

__all__ = ["ShmCommunicator", "ShmPeerError"]

_LINE = 64  # bytes per control line: one cache line, so ranks never share one
_TSO = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
_DEFAULT_SLOT_BYTES = 16 * 1024 * 1024


class ShmPeerError(RuntimeError):
    """A peer died or did not arrive at a shared-memory collective in time."""


class _FutureHandle:
    def __init__(self, future: Future[None], after: Callable[[], None] | None = None) -> None:
        self._future = future
        self._after = after  # runs on the caller's thread once the work is done

    def wait(self) -> None:
        self._future.result()
        if self._after is not None:
            self._after()
            self._after = None

    def is_completed(self) -> bool:
        return self._future.done()


def _shm_dir() -> Path:
    path = Path("/dev/shm")
    return path if path.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _reduce(stacked: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> None:
    """Reduce ``stacked`` ([L, n]) over dim 0 into ``out`` ([n])."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        torch.sum(stacked, dim=0, out=out)
        if op is ReduceOp.AVG:
            if out.dtype.is_floating_point:
                out.div_(stacked.shape[0])
            else:
                out.copy_(torch.div(out, stacked.shape[0], rounding_mode="trunc"))
    elif op is ReduceOp.MAX:
        torch.amax(stacked, dim=0, out=out)
    elif op is ReduceOp.MIN:
        torch.amin(stacked, dim=0, out=out)
    elif op is ReduceOp.PRODUCT:
        torch.prod(stacked, dim=0, out=out)
    else:
        raise TypeError(f"op must be a pc_comm.ReduceOp, got {op!r}.")


class ShmCommunicator:
    """A :class:`~pc_comm.communicator.Communicator` over the ranks of one
    host, moving data through one shared-memory segment.

    ``group`` (default: the world) must contain only processes on this host;
    it is used only during construction and, on non-x86 machines, for
    barriers. ``slot_bytes`` bounds the piece each rank writes per step (the
    segment is ``(L + 1) * slot_bytes``); ``timeout`` bounds every wait.
    Every operation runs on one worker thread in call order, so an
    ``async_op=True`` call overlaps the caller's computation. CUDA tensors are
    staged through pinned host memory on a side stream.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        slot_bytes: int = _DEFAULT_SLOT_BYTES,
        timeout: timedelta = timedelta(minutes=5),
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
        self._timeout_s = timeout.total_seconds()
        self.slot_bytes = slot_bytes
        self._check_same_host()

        control = self._world_size * _LINE
        total = control + (self._world_size + 1) * slot_bytes
        names: list[str | None] = [None]
        if self._rank == 0:
            created = str(_shm_dir() / f"pc-comm-{uuid.uuid4().hex}")
            with open(created, "wb") as handle:
                handle.truncate(total)
            names = [created]
        dist.broadcast_object_list(names, group=self.group, group_src=0)
        path = names[0]
        assert path is not None
        try:
            self._segment = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            dist.barrier(group=self.group)  # every rank has mapped the file
        finally:
            if self._rank == 0 and os.path.exists(path):
                os.unlink(path)  # [Note: segment lifetime]
        # Generation counters: element 0 of each rank's 64-byte line.
        self._arrivals = self._segment[:control].view(torch.int64).view(self._world_size, -1)[:, 0]
        self._data = self._segment[control:]
        self._generation = 0
        pids = [0] * self._world_size
        dist.all_gather_object(pids, os.getpid(), group=self.group)
        self._pids = pids
        # Pinned staging for CUDA tensors and the side stream they move on.
        self._staging: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]
        self._queue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="pc-shm-comm", daemon=True)
        self._worker.start()

    def _check_same_host(self) -> None:
        hosts: list[str] = [""] * self._world_size
        dist.all_gather_object(hosts, platform.node(), group=self.group)
        if len(set(hosts)) != 1:
            raise ValueError(
                "ShmCommunicator needs every rank on one host; the group spans "
                f"{sorted(set(hosts))}. "
                "Use HierarchicalCommunicator across nodes."
            )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"ShmCommunicator(rank={self._rank}, world_size={self._world_size})"

    # -- the worker thread ---------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                work()
            except BaseException as error:  # delivered to whoever waits
                future.set_exception(error)
            else:
                future.set_result(None)

    def _submit(self, work: Callable[[], None], async_op: bool) -> Handle:
        future: Future[None] = Future()
        self._queue.put((work, future))
        handle = _FutureHandle(future)
        if not async_op:
            handle.wait()
        return handle

    def close(self) -> None:
        """Stop the worker thread (the segment goes with the last mapping)."""
        self._queue.put(None)
        self._worker.join(timeout=5)

    # -- synchronisation -------------------------------------------------

    def _barrier(self, what: str) -> None:
        self._generation += 1
        generation = self._generation
        if not _TSO:
            dist.barrier(group=self.group)
            return
        self._arrivals[self._rank] = generation
        deadline = time.monotonic() + self._timeout_s
        spins = 0
        while int(self._arrivals.min()) < generation:
            spins += 1
            if spins < 64:
                os.sched_yield()
                continue
            time.sleep(0.0001 if spins < 4096 else 0.001)
            if spins % 256 == 0:
                self._check_peers(generation, what, deadline)

    def _check_peers(self, generation: int, what: str, deadline: float) -> None:
        missing = [r for r in range(self._world_size) if int(self._arrivals[r]) < generation]
        for rank in missing:
            try:
                os.kill(self._pids[rank], 0)
            except ProcessLookupError:
                raise ShmPeerError(
                    f"rank {rank} (pid {self._pids[rank]}) died; rank {self._rank} was "
                    f"waiting for it in shared-memory {what}."
                ) from None
        if time.monotonic() > deadline:
            raise ShmPeerError(
                f"rank(s) {missing} did not reach shared-memory {what} within "
                f"{self._timeout_s:g} s (rank {self._rank} waited)."
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

    def _share(self, count: int) -> tuple[int, int]:
        """This rank's [lo, hi) of ``count`` elements, split as evenly as can be."""
        base, extra = divmod(count, self._world_size)
        lo = self._rank * base + min(self._rank, extra)
        return lo, lo + base + (1 if self._rank < extra else 0)

    # -- host-side algorithms (run on the worker thread) -----------------------

    def _host_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> None:
        slots, result = self._slots(flat.dtype), self._result(flat.dtype)
        piece = self._piece(flat.dtype)
        for start in range(0, flat.numel(), piece):
            count = min(piece, flat.numel() - start)
            slots[self._rank, :count].copy_(flat[start : start + count])
            self._barrier("all_reduce")
            lo, hi = self._share(count)
            if hi > lo:
                _reduce(slots[:, lo:hi], op, result[lo:hi])
            self._barrier("all_reduce")
            flat[start : start + count].copy_(result[:count])

    def _host_reduce_scatter(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """``chunks[r]`` (all of one size) is reduced across ranks into rank r's ``out``."""
        slots = self._slots(out.dtype)
        size = chunks[0].numel()
        piece = max(1, self._piece(out.dtype) // self._world_size)
        for start in range(0, size, piece):
            count = min(piece, size - start)
            mine = slots[self._rank, : self._world_size * count].view(self._world_size, count)
            for r, chunk in enumerate(chunks):
                mine[r].copy_(chunk[start : start + count])
            self._barrier("reduce_scatter")
            everyone = slots[:, : self._world_size * count].view(
                self._world_size, self._world_size, count
            )
            _reduce(everyone[:, self._rank], op, out[start : start + count])
            self._barrier("reduce_scatter")

    def _host_all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[r]`` receives rank r's ``inp`` (sizes may differ by rank)."""
        slots = self._slots(inp.dtype)
        piece = self._piece(inp.dtype)
        longest = max(o.numel() for o in outs)
        for start in range(0, longest, piece):
            count = min(piece, max(0, inp.numel() - start))
            slots[self._rank, :count].copy_(inp[start : start + count])
            self._barrier("all_gather")
            for r, out in enumerate(outs):
                n = min(piece, max(0, out.numel() - start))
                out[start : start + n].copy_(slots[r, :n])
            self._barrier("all_gather")

    def _host_broadcast(self, flat: torch.Tensor, src: int) -> None:
        slots = self._slots(flat.dtype)
        piece = self._piece(flat.dtype)
        for start in range(0, flat.numel(), piece):
            count = min(piece, flat.numel() - start)
            if self._rank == src:
                slots[src, :count].copy_(flat[start : start + count])
            self._barrier("broadcast")
            if self._rank != src:
                flat[start : start + count].copy_(slots[src, :count])
            self._barrier("broadcast")

    # -- device staging ------------------------------------------------------

    def _run_staged(
        self,
        tensors_in: Sequence[torch.Tensor],
        tensors_out: Sequence[torch.Tensor],
        host_work: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
        async_op: bool,
    ) -> Handle:
        """Run ``host_work`` on host views of the given tensors. CPU tensors are
        used in place; CUDA tensors go device -> pinned host -> device on a
        side stream ordered after the caller's current stream."""
        device = next((t.device for t in [*tensors_in, *tensors_out] if t.is_cuda), None)
        if device is None:
            return self._submit(
                lambda: host_work(
                    [t.reshape(-1) for t in tensors_in], [_flat(t) for t in tensors_out]
                ),
                async_op,
            )
        return self._run_cuda(tensors_in, tensors_out, host_work, device, async_op)

    def _run_cuda(
        self,
        tensors_in: Sequence[torch.Tensor],
        tensors_out: Sequence[torch.Tensor],
        host_work: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
        device: torch.device,
        async_op: bool,
    ) -> Handle:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        stream = self._stream
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(device))
        host_in = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=True) for t in tensors_in]
        host_out = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=True) for t in tensors_out]
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]

        def work() -> None:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                for host, t in zip(host_in, tensors_in, strict=True):
                    host.copy_(t.reshape(-1), non_blocking=True)
                stream.synchronize()
                host_work(host_in, host_out)
                for host, t in zip(host_out, tensors_out, strict=True):
                    t.view(-1).copy_(host, non_blocking=True)
                done.record(stream)

        future: Future[None] = Future()
        self._queue.put((work, future))
        handle = _FutureHandle(future, lambda: torch.cuda.current_stream(device).wait_event(done))
        if not async_op:
            handle.wait()
        return handle

    # -- the Communicator protocol ----------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle:
        check_reduce_op(op)
        check_contiguous(tensor, "all_reduce tensor")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            if ins[0].data_ptr() != outs[0].data_ptr():
                outs[0].copy_(ins[0])
            self._host_all_reduce(outs[0], op)

        return self._run_staged([tensor], [tensor], work, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        check_reduce_op(op)
        check_reduce_scatter(output, input, self._world_size)
        check_contiguous(output, "reduce_scatter output")
        world = self._world_size

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_reduce_scatter(outs[0], list(ins[0].view(world, -1)), op)

        return self._run_staged([input], [output], work, async_op)

    def reduce_scatter_list(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        check_reduce_op(op)
        check_reduce_scatter_list(output, inputs, self._rank, self._world_size)
        check_contiguous(output, "reduce_scatter_list output")
        slot = max(t.numel() for t in inputs)
        count = output.numel()

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            padded = [_padded(t, slot) for t in ins]
            mine = outs[0].new_empty(slot)
            self._host_reduce_scatter(mine, padded, op)
            outs[0].copy_(mine[:count])

        return self._run_staged(list(inputs), [output], work, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather(output, input, self._world_size)
        check_contiguous(output, "all_gather output")
        world = self._world_size

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_all_gather(list(outs[0].view(world, -1)), ins[0])

        return self._run_staged([input], [output], work, async_op)

    def all_gather_list(
        self, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather_list(outputs, input, self._rank, self._world_size)
        for i, out in enumerate(outputs):
            check_contiguous(out, f"all_gather_list outputs[{i}]")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_all_gather(outs, ins[0])

        return self._run_staged([input], list(outputs), work, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be a rank in [0, {self._world_size}), got {src}.")
        check_contiguous(tensor, "broadcast tensor")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            if ins[0].data_ptr() != outs[0].data_ptr():
                outs[0].copy_(ins[0])
            self._host_broadcast(outs[0], src)

        return self._run_staged([tensor], [tensor], work, async_op)

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Handle:
        raise NotImplementedError(
            "ShmCommunicator implements collectives only; use TorchCommunicator for "
            "send/recv (pipelines)."
        )

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        raise NotImplementedError(
            "ShmCommunicator implements collectives only; use TorchCommunicator for "
            "send/recv (pipelines)."
        )

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        raise NotImplementedError(
            "ShmCommunicator implements collectives only; use TorchCommunicator for "
            "send/recv (pipelines)."
        )

    def barrier(self) -> None:
        self._submit(lambda: self._barrier("barrier"), async_op=False)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1)


def _padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    if tensor.numel() == size:
        return tensor
    out = tensor.new_zeros(size)
    out[: tensor.numel()].copy_(tensor)
    return out
