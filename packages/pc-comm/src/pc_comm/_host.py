"""Host-side execution shared by the communicators that compute on the CPU.

A :class:`HostExecutor` owns one worker thread that runs operations in call
order (so every rank issues its collectives in the same order, and an
``async_op=True`` call overlaps the caller's work), and stages CUDA tensors
through pinned host memory on a side stream ordered after the caller's
current stream. It implements the collectives of the Communicator protocol
(input checks, staging, uneven lists) over four host algorithms a subclass
provides: ``_host_all_reduce``, ``_host_reduce_scatter``,
``_host_all_gather`` and ``_host_broadcast``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from pc_comm import health
from pc_comm.communicator import (
    Handle,
    ReduceOp,
    check_all_gather,
    check_all_gather_list,
    check_contiguous,
    check_reduce_op,
    check_reduce_scatter,
    check_reduce_scatter_list,
)

__all__ = ["HostExecutor", "padded"]


class _FutureHandle:
    def __init__(self, future: Future[None], after: Callable[[], None] | None = None) -> None:
        self._future = future
        self._after = after  # runs on the caller's thread once the work is done

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.result(timeout)
        except FutureTimeout as error:
            raise TimeoutError(f"operation not completed within {timeout} s") from error
        if self._after is not None:
            self._after()
            self._after = None

    def is_completed(self) -> bool:
        return self._future.done()


class HostExecutor:
    """The worker thread, CUDA staging and collectives of a host-side
    communicator. Subclasses set ``_rank`` and ``_world_size`` and provide
    the ``_host_*`` algorithms, which run on the worker thread on flat host
    tensors."""

    _rank: int
    _world_size: int

    def __init__(self, thread_name: str) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None  # pinned, reused by every CUDA operation
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]
        self._queue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._worker.start()

    # -- the worker thread ---------------------------------------------------

    def _serve(self) -> None:
        # Collectives move data, never gradients: copies into tensors a
        # caller made under no_grad (an autograd Function's outputs) are
        # not recorded.
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, future = item
            del item
            if not future.set_running_or_notify_cancel():
                continue
            error: BaseException | None = None
            try:
                work()
            except BaseException as raised:  # delivered to whoever waits
                error = raised
            # The work's tensors are released before the waiter wakes: a
            # buffer the caller drops after ``wait()`` is then freed on the
            # caller's thread, when it drops it, never later on this one
            # (where a memory profiler of the caller's thread cannot see it).
            del work
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            del error

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

    # -- device staging ------------------------------------------------------

    def _staging_views(
        self, tensors_in: Sequence[torch.Tensor], tensors_out: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host views for the tensors of one operation, carved from one pinned
        buffer that grows but is never reallocated per call (pinning is slow).
        A tensor that is both input and output gets one view. Reuse is safe:
        operations run one at a time on the worker thread, and each waits
        for its side stream before touching the host copies, so the previous
        operation's copies out of the buffer have finished."""
        views: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {}
        offset = 0
        for t in [*tensors_in, *tensors_out]:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in views:
                offset = -(-offset // 64) * 64
                views[key] = (offset, t.numel() * t.element_size())
                offset += t.numel() * t.element_size()
        if self._staging is None or self._staging.numel() < offset:
            self._staging = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=True)
        staging = self._staging

        def view(t: torch.Tensor) -> torch.Tensor:
            start, nbytes = views[(t.data_ptr(), t.numel(), t.dtype)]
            return staging[start : start + nbytes].view(t.dtype)

        return [view(t) for t in tensors_in], [view(t) for t in tensors_out]

    def _run_staged(
        self,
        tensors_in: Sequence[torch.Tensor],
        tensors_out: Sequence[torch.Tensor],
        host_work: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
        async_op: bool,
        op: str,
    ) -> Handle:
        """Run ``host_work`` on host views of the given tensors. CPU tensors are
        used in place; CUDA tensors go device -> pinned host -> device on a
        side stream ordered after the caller's current stream. ``op`` names
        the operation on the health board (pc_comm.health)."""
        health.started(op, tensors_out[0] if tensors_out else tensors_in[0])
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
        host_in, host_out = self._staging_views(tensors_in, tensors_out)
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

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- host algorithms (subclasses) ------------------------------------------

    def _host_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> None:
        raise NotImplementedError

    def _host_reduce_scatter(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """``chunks[r]`` (all of one size) is reduced across ranks into rank r's ``out``."""
        raise NotImplementedError

    def _host_all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[r]`` receives rank r's ``inp`` (sizes may differ by rank)."""
        raise NotImplementedError

    def _host_broadcast(self, flat: torch.Tensor, src: int) -> None:
        raise NotImplementedError

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

        return self._run_staged([tensor], [tensor], work, async_op, "all_reduce")

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

        return self._run_staged([input], [output], work, async_op, "reduce_scatter")

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
            stretched = [padded(t, slot) for t in ins]
            mine = outs[0].new_empty(slot)
            self._host_reduce_scatter(mine, stretched, op)
            outs[0].copy_(mine[:count])

        return self._run_staged(list(inputs), [output], work, async_op, "reduce_scatter_list")

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather(output, input, self._world_size)
        check_contiguous(output, "all_gather output")
        world = self._world_size

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_all_gather(list(outs[0].view(world, -1)), ins[0])

        return self._run_staged([input], [output], work, async_op, "all_gather")

    def all_gather_list(
        self, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather_list(outputs, input, self._rank, self._world_size)
        for i, out in enumerate(outputs):
            check_contiguous(out, f"all_gather_list outputs[{i}]")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            self._host_all_gather(outs, ins[0])

        return self._run_staged([input], list(outputs), work, async_op, "all_gather_list")

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be a rank in [0, {self._world_size}), got {src}.")
        check_contiguous(tensor, "broadcast tensor")

        def work(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            if ins[0].data_ptr() != outs[0].data_ptr():
                outs[0].copy_(ins[0])
            self._host_broadcast(outs[0], src)

        return self._run_staged([tensor], [tensor], work, async_op, "broadcast")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1)


def padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    if tensor.numel() == size:
        return tensor
    out = tensor.new_zeros(size)
    out[: tensor.numel()].copy_(tensor)
    return out
