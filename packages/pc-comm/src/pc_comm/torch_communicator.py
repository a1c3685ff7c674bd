"""The default :class:`~pc_comm.communicator.Communicator`: torch.distributed.

It adds to the raw c10d calls what every backend should offer but not every
one does: ``AVG`` on any dtype (gloo averages only floating tensors), uneven
all-gather and reduce-scatter (padded to the largest slot; gloo rejects
unequal sizes), group-local ranks everywhere, and input checks with clear
messages. A call that fails because a peer died or stalled raises
:class:`~pc_comm.health.PeerFailureError`, naming the operation and where
the other ranks are (see pc_comm.health).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import health
from pc_comm.communicator import (
    CompletedHandle,
    Handle,
    P2PKind,
    P2POp,
    ReduceOp,
    check_all_gather,
    check_all_gather_list,
    check_contiguous,
    check_reduce_op,
    check_reduce_scatter,
    check_reduce_scatter_list,
    divide_for_average,
)

__all__ = ["TorchCommunicator"]

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

Finisher = Callable[[], None]


Failure = Callable[[RuntimeError], BaseException]


# torch 2.13 names the flat collectives all_gather_single / reduce_scatter_single;
# earlier releases call them all_gather_into_tensor / reduce_scatter_tensor
# (same arguments).
_all_gather_flat: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_reduce_scatter_flat: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


class _WorkHandle:
    """A torch ``Work`` plus what must happen after it: copying a padded
    buffer out, or dividing an emulated average. ``failure`` turns the
    backend's error into the one to raise."""

    def __init__(self, work: dist.Work | None, finishers: list[Finisher], failure: Failure) -> None:
        self._work = work
        self._finishers = finishers  # run once, in order, on the first wait()
        self._failure = failure
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        if self._work is not None:
            start = time.monotonic()
            try:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as error:
                # Backends word their timeouts differently; the clock does not.
                if timeout is not None and time.monotonic() - start >= 0.99 * timeout:
                    raise TimeoutError(f"operation not completed within {timeout} s") from error
                raise self._failure(error) from error
        for finish in self._finishers:
            finish()
        self._done = True

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())


class TorchCommunicator:
    """A communicator over a torch.distributed process group (the default
    group when ``group`` is None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator needs an initialised process group; call "
                "pc_comm.init_distributed() (or dist.init_process_group) first."
            )
        # The group every call goes to; WORLD when none is given.
        world = dist.group.WORLD
        assert world is not None, "initialised, yet no WORLD group"
        self.group: dist.ProcessGroup = group if group is not None else world
        self._rank = dist.get_rank(self.group)
        self._world_size = dist.get_world_size(self.group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group.")
        # gloo averages floating tensors natively but not integers; NCCL
        # averages everything. Anything else is emulated as SUM then divide.
        self._native_avg_ints = str(dist.get_backend(self.group)) == "nccl"
        self._global_ranks = dist.get_process_group_ranks(self.group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"TorchCommunicator(rank={self._rank}, world_size={self._world_size})"

    # -- running one operation ---------------------------------------------

    def _failure_for(self, name: Callable[[], str]) -> Failure:
        """Turns a backend error into a PeerFailureError where a peer caused
        it; ``name`` formats the operation, only then."""

        def failure(error: RuntimeError) -> BaseException:
            if not health.is_peer_failure(error):
                return error
            return health.diagnose(error, name(), self._global_ranks)

        return failure

    def _run(
        self,
        op: str,
        tensor: torch.Tensor,
        call: Callable[[], dist.Work | None],
        finishers: list[Finisher],
        async_op: bool,
    ) -> Handle:
        """Start ``call`` (a c10d call), noted on the health board as ``op``;
        a failure caused by a peer becomes a PeerFailureError that names
        the operation and where the other ranks are."""
        health.started(op, tensor)
        failure = self._failure_for(lambda: health.op_name(op, tensor.dtype, tensor.numel()))
        try:
            work = call()
        except RuntimeError as error:
            raise failure(error) from error
        handle = _WorkHandle(work, finishers, failure)
        if async_op:
            return handle
        handle.wait()
        return CompletedHandle()

    # -- reductions --------------------------------------------------------

    def _torch_op(
        self, op: ReduceOp, result: torch.Tensor
    ) -> tuple[dist.ReduceOp.RedOpType, list[Finisher]]:
        """The c10d op to run, and the division to apply afterwards when AVG
        is emulated for ``result``'s dtype."""
        check_reduce_op(op)
        native = result.dtype.is_floating_point or self._native_avg_ints
        if op is not ReduceOp.AVG or native:
            return _TORCH_OPS[op], []
        world_size = self._world_size

        def divide() -> None:
            divide_for_average(result, world_size)

        return dist.ReduceOp.SUM, [divide]

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle:
        check_contiguous(tensor, "all_reduce tensor")
        torch_op, finishers = self._torch_op(op, tensor)
        return self._run(
            "all_reduce",
            tensor,
            lambda: dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=async_op),
            finishers,
            async_op,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        check_reduce_scatter(output, input, self._world_size)
        check_contiguous(output, "reduce_scatter output")
        check_contiguous(input, "reduce_scatter input")
        torch_op, finishers = self._torch_op(op, output)
        return self._run(
            "reduce_scatter",
            input,
            lambda: _reduce_scatter_flat(
                output.view(-1), input.view(-1), op=torch_op, group=self.group, async_op=async_op
            ),
            finishers,
            async_op,
        )

    def reduce_scatter_list(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle:
        check_reduce_scatter_list(output, inputs, self._rank, self._world_size)
        slot = max(t.numel() for t in inputs)
        flat = output.new_zeros(self._world_size * slot)
        for i, tensor in enumerate(inputs):
            flat[i * slot : i * slot + tensor.numel()].copy_(tensor.reshape(-1))
        mine = output.new_empty(slot)
        torch_op, finishers = self._torch_op(op, mine)
        count = output.numel()

        def copy_out() -> None:
            output.copy_(mine[:count].view_as(output))

        finishers.append(copy_out)
        return self._run(
            "reduce_scatter",
            flat,
            lambda: _reduce_scatter_flat(
                mine, flat, op=torch_op, group=self.group, async_op=async_op
            ),
            finishers,
            async_op,
        )

    # -- gathers -----------------------------------------------------------

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather(output, input, self._world_size)
        check_contiguous(output, "all_gather output")
        return self._run(
            "all_gather",
            output,
            lambda: _all_gather_flat(
                output.view(-1), input.reshape(-1), group=self.group, async_op=async_op
            ),
            [],
            async_op,
        )

    def all_gather_list(
        self, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        check_all_gather_list(outputs, input, self._rank, self._world_size)
        slot = max(t.numel() for t in outputs)
        if input.numel() == slot:
            mine = input.reshape(-1)
        else:
            mine = input.new_zeros(slot)
            mine[: input.numel()].copy_(input.reshape(-1))
        gathered = input.new_empty(self._world_size * slot)

        def scatter_out() -> None:
            for i, out in enumerate(outputs):
                out.copy_(gathered[i * slot : i * slot + out.numel()].view_as(out))

        return self._run(
            "all_gather",
            gathered,
            lambda: _all_gather_flat(gathered, mine, group=self.group, async_op=async_op),
            [scatter_out],
            async_op,
        )

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        self._check_peer(src, "src", allow_self=True)
        check_contiguous(tensor, "broadcast tensor")
        return self._run(
            f"broadcast from {src}",
            tensor,
            lambda: dist.broadcast(tensor, group=self.group, group_src=src, async_op=async_op),
            [],
            async_op,
        )

    # -- point to point ----------------------------------------------------

    def _check_peer(self, peer: int, name: str, *, allow_self: bool = False) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"{name} must be an int rank, got {peer!r}.")
        if not 0 <= peer < self._world_size:
            raise ValueError(
                f"{name} must be a rank of this communicator in [0, {self._world_size}), "
                f"got {peer}."
            )
        if not allow_self and peer == self._rank:
            raise ValueError(f"{name}={peer} is this rank itself; a rank cannot message itself.")

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Handle:
        self._check_peer(dst, "dst")
        check_contiguous(tensor, "send tensor")
        return self._run(
            f"send to {dst}",
            tensor,
            lambda: dist.isend(tensor, group=self.group, group_dst=dst),
            [],
            async_op,
        )

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        self._check_peer(src, "src")
        check_contiguous(tensor, "recv tensor")
        return self._run(
            f"recv from {src}",
            tensor,
            lambda: dist.irecv(tensor, group=self.group, group_src=src),
            [],
            async_op,
        )

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        torch_ops = []
        for op in ops:
            self._check_peer(op.peer, "peer")
            check_contiguous(op.tensor, f"{op.kind.value} tensor")
            fn = dist.isend if op.kind is P2PKind.SEND else dist.irecv
            torch_ops.append(dist.P2POp(fn, op.tensor, group=self.group, group_peer=op.peer))
        if not torch_ops:
            return []
        health.started("batch_p2p")

        def name() -> str:
            return " + ".join(
                f"{op.kind.value} {'to' if op.kind is P2PKind.SEND else 'from'} {op.peer}"
                for op in ops
            )

        failure = self._failure_for(name)
        try:
            works = dist.batch_isend_irecv(torch_ops)
        except RuntimeError as error:
            raise failure(error) from error
        return [_WorkHandle(work, [], failure) for work in works]

    def barrier(self) -> None:
        health.started("barrier")
        try:
            dist.barrier(group=self.group)
        except RuntimeError as error:
            raise self._failure_for(lambda: "barrier")(error) from error
