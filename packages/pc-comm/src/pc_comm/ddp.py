"""Data parallelism with bucketed gradient all-reduce that overlaps backward.

[Note: bucket order]
Parameters are packed into buckets in reverse registration order (backward
produces gradients roughly from the last layer to the first). A bucket's
all-reduce starts as soon as all its gradients are accumulated, but buckets
are launched strictly in index order: bucket k waits for buckets < k to be
launched. Every rank therefore issues the same collectives in the same order,
even when gradients become ready in a different order on different ranks.

[Note: end of backward]
The first gradient hook of a backward pass queues a callback that autograd
runs once the whole backward is done. It launches what is left (zero-filled
slots for unused parameters, if allowed), waits for every bucket, and copies
the averaged gradients back into ``param.grad``. So ``loss.backward()``
returns with synchronised gradients, as with torch DDP.

[Note: gradients as bucket views]
With ``gradient_as_bucket_view=True`` (the default) each ``param.grad``
becomes a view into its bucket the first time it is reduced, so the reduced
gradient never needs copying back, and a later backward that accumulates
into an existing gradient (``zero_grad(set_to_none=False)``, ``no_sync``)
writes straight into the bucket: no copy in either. On host memory, buckets
come from the communicator's symmetric allocator when it has one (shared
memory), so the all-reduce itself needs no staging copies. A gradient set to
None by ``zero_grad()`` arrives as a fresh tensor, is copied into the bucket
once, and becomes a view again.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_comm.communicator import Communicator, Handle, ReduceOp, SymmetricAllocator
from pc_comm.hierarchical import HierarchicalCommunicator
from pc_comm.hooks import weak_method
from pc_comm.shm import ShmCommunicator

__all__ = ["DistributedDataParallel", "Reducer", "default_communicator", "on_one_host"]


def on_one_host(group: dist.ProcessGroup | None = None) -> bool:
    """Collective: whether every rank of ``group`` runs on this host."""
    hosts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(hosts, platform.node(), group=group)
    return len(set(hosts)) == 1


def default_communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """Shared memory when every rank of ``group`` is on this host; otherwise
    shared memory inside each node and torch.distributed between nodes."""
    if on_one_host(group):
        return ShmCommunicator(group)
    return HierarchicalCommunicator(group)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor  # allocated once; gradients live in it [Note: gradients as bucket views]
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's slot, made once
    pending: int = 0  # gradients still to arrive in this backward
    handle: Handle | None = None
    arrived: set[int] = field(default_factory=set)  # indices (in params) that arrived


class Reducer:
    """The gradient machinery of one :class:`DistributedDataParallel`."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: dict[nn.Parameter, str],
        comm: Communicator,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool = True,
    ) -> None:
        self.comm = comm
        self._names = names  # for error messages about unused parameters
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self.buckets = self._build_buckets(params, bucket_cap_bytes, comm)
        self._where: dict[nn.Parameter, tuple[int, int]] = {
            p: (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)
        }
        self._next_launch = 0  # the lowest bucket not yet launched [Note: bucket order]
        self._callback_queued = False
        self.sync_enabled = True  # False inside no_sync()
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_method(self._on_grad))  # type: ignore[no-untyped-call]
            for p in params
        ]
        self._reset()

    @staticmethod
    def _build_buckets(params: list[nn.Parameter], cap: int, comm: Communicator) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for param in reversed(params):
            fits = current and current[0].dtype == param.dtype and current[0].device == param.device
            if current and (not fits or size + param.numel() * param.element_size() > cap):
                groups.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
        if current:
            groups.append(current)
        # One flat tensor per (dtype, device); every bucket is a slice of it.
        totals: dict[tuple[torch.dtype, torch.device], int] = {}
        for group in groups:
            key = (group[0].dtype, group[0].device)
            totals[key] = totals.get(key, 0) + sum(p.numel() for p in group)
        storage: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for (dtype, device), total in totals.items():
            if device.type == "cpu" and isinstance(comm, SymmetricAllocator):
                storage[dtype, device] = comm.alloc(total, dtype)  # collective, same on all ranks
            else:
                storage[dtype, device] = torch.zeros(total, dtype=dtype, device=device)
        buckets, used = [], dict.fromkeys(totals, 0)
        for group in groups:
            key = (group[0].dtype, group[0].device)
            offsets, count = [], 0
            for p in group:
                offsets.append(count)
                count += p.numel()
            flat = storage[key][used[key] : used[key] + count]
            used[key] += count
            views = [
                flat[offset : offset + p.numel()].view_as(p)
                for p, offset in zip(group, offsets, strict=True)
            ]
            buckets.append(_Bucket(params=group, offsets=offsets, flat=flat, views=views))
        return buckets

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.handle = None
            bucket.arrived = set()
        self._next_launch = 0
        self._callback_queued = False

    @staticmethod
    def _slot(bucket: _Bucket, index: int) -> torch.Tensor:
        # One view object per parameter, made once: ``param.grad is slot``
        # then tells a gradient already in its bucket in one comparison, and
        # no view is built per gradient per step.
        return bucket.views[index]

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        b, i = self._where[param]  # type: ignore[index]
        self._arrive(self.buckets[b], i)

    def _arrive(self, bucket: _Bucket, i: int) -> None:
        param = bucket.params[i]
        if i in bucket.arrived:
            raise RuntimeError(
                f"parameter {self._names[bucket.params[i]]!r} received a gradient twice in one "
                "backward pass (a module reused in a loop?); DistributedDataParallel "
                "reduces each gradient once per backward."
            )
        grad = param.grad
        assert grad is not None
        slot = self._slot(bucket, i)
        if grad is not slot and not _is_view_of(grad, slot):
            slot.copy_(grad)
            if self._as_view:
                param.grad = slot  # [Note: gradients as bucket views]
        bucket.arrived.add(i)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            bucket = self.buckets[self._next_launch]
            bucket.handle = self.comm.all_reduce(bucket.flat, ReduceOp.AVG, async_op=True)
            self._next_launch += 1

    def _finish(self) -> None:
        try:
            unused = self._fill_unused()
            self._launch_ready()
            assert self._next_launch == len(self.buckets), "a bucket was never launched"
            used_anywhere = self._used_anywhere(unused)
            for bucket in self.buckets:
                assert bucket.handle is not None
                bucket.handle.wait()
                for i, param in enumerate(bucket.params):
                    if param in unused and not used_anywhere[param]:
                        continue  # unused on every rank: the gradient stays as it was
                    slot = self._slot(bucket, i)
                    if self._as_view:
                        if param.grad is not slot:  # most are already (see _arrive)
                            param.grad = slot
                    elif param.grad is None:
                        param.grad = slot.clone()
                    else:
                        param.grad.copy_(slot)
        finally:
            self._reset()

    def _fill_unused(self) -> set[nn.Parameter]:
        """Zero the slots of parameters that got no gradient in this backward,
        or raise if that is not allowed."""
        unused: set[nn.Parameter] = set()
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                if i not in bucket.arrived:
                    unused.add(param)
        if unused and not self._find_unused:
            names = sorted(self._names[p] for p in unused)
            raise RuntimeError(
                f"{len(names)} parameter(s) received no gradient in this backward pass: "
                f"{names}. Pass find_unused_parameters=True to DistributedDataParallel, or "
                "exclude them from the module (requires_grad=False)."
            )
        for bucket in self.buckets:
            for i in set(range(len(bucket.params))) - bucket.arrived:
                slot, param = self._slot(bucket, i), bucket.params[i]
                if param.grad is not None and _is_view_of(param.grad, slot):
                    param.grad = param.grad.clone()  # keep it if no rank used the parameter
                slot.zero_()
                bucket.pending -= 1
        return unused

    def _used_anywhere(self, unused: set[nn.Parameter]) -> dict[nn.Parameter, bool]:
        """Which locally unused parameters some other rank did use: their
        averaged gradient counts this rank's zeros, as torch DDP does."""
        if not self._find_unused:
            return {}
        params = [p for bucket in self.buckets for p in bucket.params]
        used = torch.tensor([0 if p in unused else 1 for p in params], dtype=torch.int64)
        self.comm.all_reduce(used, ReduceOp.MAX)
        return {p: bool(flag) for p, flag in zip(params, used.tolist(), strict=True)}

    def reduce_accumulated(self) -> None:
        """Average every gradient accumulated so far, now, as the end of a
        backward pass would (see ``DistributedDataParallel.sync_gradients``)."""
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                if param.grad is not None:
                    self._arrive(bucket, i)
        self._finish()

    def stop(self) -> None:
        """Remove the gradient hooks and stop the communicator's worker
        thread, if it has one (haiscale's ``reducer.stop()``)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        close = getattr(self.comm, "close", None)
        if callable(close):
            close()


class DistributedDataParallel(nn.Module):
    """Replicate ``module`` on every rank and average gradients during backward.

    Call-compatible with haiscale's and torch's wrappers: ``ddp(x)`` runs the
    module, ``loss.backward()`` returns with gradients averaged over ranks
    (sum / world size, as torch DDP), ``no_sync()`` accumulates locally, and
    ``ddp.reducer.stop()`` releases the background machinery.

    ``communicator`` defaults to shared memory when every rank is on this
    host (hfreduce-style: the reduction runs on the host, off the compute
    stream) and to torch.distributed otherwise; ``process_group`` selects the
    ranks. Gradients are packed into buckets of ``bucket_cap_mb`` MiB in
    reverse registration order, each all-reduced as soon as it is full,
    overlapping the rest of backward. A parameter that receives no gradient
    is an error unless ``find_unused_parameters=True``. With
    ``gradient_as_bucket_view`` (default True, unlike torch) gradients are
    views into the buckets, which saves two copies per step; pass False to
    keep separate gradient tensors. ``ignored_parameters`` are neither
    synchronised from rank 0 nor reduced (parameters that differ by rank on
    purpose: expert-parallel shards, whose gradients another group owns).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        communicator: Communicator | None = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
        ignored_parameters: Iterable[nn.Parameter] = (),
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}.")
        if communicator is not None and process_group is not None:
            raise ValueError(
                "pass either process_group or communicator, not both: a communicator "
                "already knows its ranks."
            )
        self.module = module
        self.comm = (
            communicator if communicator is not None else default_communicator(process_group)
        )
        self.broadcast_buffers = broadcast_buffers
        names = {p: n for n, p in module.named_parameters()}
        ignored = {id(p) for p in ignored_parameters}
        kept = [p for p in module.parameters() if id(p) not in ignored]
        params = [p for p in kept if p.requires_grad]
        if not params:
            raise ValueError("module has no parameter that requires a gradient.")
        self._sync_from_rank0(kept + list(module.buffers()))
        self.reducer = Reducer(
            params,
            names,
            self.comm,
            int(bucket_cap_mb * 1024 * 1024),
            find_unused_parameters,
            gradient_as_bucket_view,
        )

    def _sync_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        with torch.no_grad():
            for group in by_kind.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.comm.broadcast(flat, src=0)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                self._sync_from_rank0(buffers)
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        """Average the gradients accumulated so far across ranks, now.

        For code that runs backward in several pieces under ``no_sync()``
        and reduces once at the end: a pipeline stage whose microbatches'
        backward passes (or split input and weight gradients) come one by
        one. A parameter without a gradient counts as unused.
        """
        self.reducer.reduce_accumulated()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block
        reduces the accumulated sum."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous


def _is_view_of(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        tensor.data_ptr() == slot.data_ptr()
        and tensor.shape == slot.shape
        and tensor.stride() == slot.stride()
        and tensor.dtype == slot.dtype
    )
