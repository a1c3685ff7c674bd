"""ZeRO stage 1 and 2: the optimizer states (and with stage 2 the gradients)
sharded across the data-parallel ranks.

[Note: a step]
Parameters live in flat per-group buffers cut into buckets, each bucket
split evenly into one piece per rank [Note: layout]. The wrapped optimizer
steps one fp32 *master* tensor per piece: the piece itself in fp32 training
(a view, no copy), an fp32 copy otherwise.

- Backward. Stage 1: each gradient is copied (or, when accumulating, added)
  into a flat gradient buffer and freed; outside ``no_sync`` each bucket is
  reduce-scattered (averaged) into this rank's gradient piece the moment its
  last gradient arrives, overlapping the rest of backward. Stage 2: each
  gradient is copied into its bucket's staging buffer and freed; a full
  bucket is reduce-scattered and *added* into the rank's persistent gradient
  shard, so only 1/N of the gradients is ever kept.
- Buckets are launched strictly in one order on every rank (expected
  arrival order), so the collectives match even when ranks use different
  parameters; the end of backward launches whatever is left.
- ``step()``: waits for the reductions, converts the rank's gradient pieces
  to fp32 and unscales them, all-reduces one pair (non-finite flag, squared
  norm) for the overflow check and clipping, steps the masters, writes them
  back into the working pieces and all-gathers every bucket.

[Note: gradient accumulation]
Stage 1: call backward under ``no_sync()`` for all but the last micro-batch;
nothing is communicated until the last. Without ``no_sync`` each backward
reduces the whole accumulated buffer again: correct (the gradient piece is
overwritten by the latest reduction) but wasteful. Stage 2 keeps no full
gradients, so every backward reduces its micro-batch and adds it into the
shard; ``no_sync()`` raises. Either way the result equals single-process
accumulation. Parameters' ``.grad`` are ``None`` after backward in both
stages: the gradients live in the optimizer's buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pc_comm import (
    Communicator,
    Handle,
    ReduceOp,
    SymmetricAllocator,
    default_communicator,
    weak_method,
)
from pc_offload import (
    StateDtype,
    adam_storing,
    check_own_masters,
    check_storable,
    is_narrow,
    stored_bytes,
    widen,
)
from pc_zero.clipping import ClipsInStep
from pc_zero.layout import Bucket, Slot, plan_buckets
from pc_zero.loss_scale import (
    DynamicLossScaler,
    LossScaleConfig,
    NonFiniteGradientError,
    counts_under_tensor_parallel,
    norm_groups,
    reduced_squares,
    unscale_clip_and_check,
)
from pc_zero.memory import ModelStateMemory
from pc_zero.protocols import OwnedPiece
from pc_zero.state import full_state_dict, plan_load, sharded_state_dict

__all__ = ["LowLevelZeroOptimizer"]

_HOST = torch.device("cpu")
# [Note: two-level sharding]
# Sharding over every rank puts every all-gather and reduce-scatter across
# the slow links between nodes. With a replica group, each shard group (the
# ranks of one node, say) shards the model as ZeRO does, and the ranks that
# hold the same shard in the other groups (one per node) average their
# reduced gradient pieces at the step: 1/shard of the gradients crosses the
# slow link, once a step, as an all-reduce. The step, the gather of the
# parameters and the norm stay inside the shard group (the replicas hold
# the same values). Colossal-AI calls the replica count extra_dp_size.

# Stage 2 reductions in flight before the oldest is waited for: enough that
# backward rarely waits (2 cost 10% of a step in bench_zero.py), few enough
# that staging memory stays a handful of buckets.
_MAX_IN_FLIGHT = 8

# [Note: staging]
# Stage 2 copies each gradient into its bucket's staging buffer, reduce-
# scatters the full bucket into the rank's 1/N shard and recycles the buffer
# for a later bucket of this backward: at most _MAX_IN_FLIGHT buffers are in
# reductions and a few more filling, each reused by any bucket it fits. Once
# the reductions are waited for (the step, zero_grad) the pool is dropped, so
# between steps a rank holds no staging at all, and during backward at most
# (_MAX_IN_FLIGHT + buckets filling at once) x the largest bucket. A pool kept
# per bucket size held a buffer for nearly every bucket, 0.8x the model's
# gradients on a 12-bucket Qwen2, and ZeRO-2 no smaller than DDP at world 2.


def _checked_stage(
    optimizer: Optimizer, stage: int, partition_grad: bool | None, max_norm: float
) -> int:
    """The ZeRO stage (``partition_grad``, when given, decides it), after
    checking the constructor's arguments."""
    if partition_grad is not None:
        stage = 2 if partition_grad else 1
    if stage not in (1, 2):
        raise ValueError(
            f"LowLevelZeroOptimizer: stage must be 1 or 2, got {stage}. "
            "Stage 3 is pc_zero.FullyShardedDataParallel."
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"LowLevelZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer)}."
        )
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0 (0 disables), got {max_norm}.")
    return stage


def _one_dtype_and_device(params: list[torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    """The one dtype and device of the trainable ``params``."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("LowLevelZeroOptimizer: the optimizer has no parameter requiring grad.")
    dtypes = {p.dtype for p in trainable}
    devices = {p.device for p in trainable}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(
            "LowLevelZeroOptimizer: every trainable parameter must share one dtype and "
            f"device, got dtypes {sorted(map(str, dtypes))} on {sorted(map(str, devices))}. "
            "Convert the model (model.to(dtype)) before building the optimizer."
        )
    return dtypes.pop(), devices.pop()


class LowLevelZeroOptimizer(ClipsInStep, Optimizer):
    """Wraps ``optimizer`` (built over the model's parameters) with ZeRO
    stage 1 or 2 [Note: a step].

    ``stage``: 1 shards optimizer states, 2 also gradients
    (``partition_grad=True`` is stage 2's older spelling).
    ``comm`` / ``dp_process_group``: the data-parallel ranks (default: every
    rank, through shared memory on one host). ``reduce_bucket_size``:
    elements per bucket. ``max_norm``: max global norm, 0 for none; settable, and
    :meth:`clip_next_step` clips one step [Note: clipping inside the step]
    in pc_zero.clipping.
    ``loss_scale``: the dynamic scale for fp16 parameters (on by default for
    fp16, unused otherwise). ``cpu_offload``: masters, optimizer states and
    the step on the host (Adam/AdamW step through pc-offload's fused CPU
    optimizers). ``optimizer_states``: how Adam's moments are stored,
    ``"fp32"``, ``"bf16"`` or ``"int8"`` (pc-offload's [Note: low-precision
    optimizer states]; torch's Adam/AdamW then step through pc-offload's).
    ``nvme_offload_fraction`` / ``nvme_offload_dir`` (with ``cpu_offload``):
    that share of Adam's moments in scratch files on local disk
    ([Note: the NVMe tier] in pc_offload.nvme), as Colossal-AI's HybridAdam.

    The global norm (clipping, and the fp16 overflow check) spans the whole
    model [Note: global norm across groups]: ``model_parallel_groups`` are
    the groups, besides the data-parallel ranks, over which the parameters
    differ (pipeline stages, tensor-parallel shards), and
    ``counts_toward_norm(param)`` says whether this rank counts an original
    parameter (so a parameter held by several of those ranks counts once;
    default: every parameter). ``tp_process_group``: the tensor-parallel
    group the model is sharded over (pc_tensor); it joins
    ``model_parallel_groups``, and the default rule becomes
    :func:`pc_zero.counts_under_tensor_parallel`: the parameters marked
    ``tensor_model_parallel`` count on every tensor-parallel rank, the
    others, which every tensor-parallel rank holds whole, on tensor-parallel
    rank 0 only. A ``counts_toward_norm`` given replaces the default rule:
    under tensor and pipeline parallelism together, combine that rule with
    the pipeline's (e.g. a tied weight counts on the first stage only).

    ``replica_process_group``: two-level sharding [Note: two-level
    sharding], the ranks that hold the same shards as this one (each in
    another ``dp_process_group``); their gradient pieces are averaged after
    the reduce-scatter inside ``dp_process_group``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        stage: int = 1,
        *,
        comm: Communicator | None = None,
        dp_process_group: dist.ProcessGroup | None = None,
        reduce_bucket_size: int = 1024 * 1024,
        overlap_communication: bool = True,
        max_norm: float = 0.0,
        loss_scale: LossScaleConfig | None = None,
        cpu_offload: bool = False,
        partition_grad: bool | None = None,
        tp_process_group: dist.ProcessGroup | None = None,
        model_parallel_groups: Sequence[dist.ProcessGroup] = (),
        counts_toward_norm: Callable[[torch.Tensor], bool] | None = None,
        replica_process_group: dist.ProcessGroup | None = None,
        optimizer_states: str | StateDtype = "fp32",
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
    ) -> None:
        self.stage = _checked_stage(optimizer, stage, partition_grad, max_norm)
        self.optimizer_states = check_storable(optimizer, optimizer_states, nvme_offload_fraction)
        if nvme_offload_fraction and not cpu_offload:
            raise ValueError(
                f"nvme_offload_fraction={nvme_offload_fraction:g} puts states the host steps on "
                "disk; pass cpu_offload=True with it, or nvme_offload_fraction=0."
            )
        self._disk: dict[str, Any] = {
            "nvme_offload_fraction": float(nvme_offload_fraction),
            "nvme_offload_dir": nvme_offload_dir,
        }
        self.comm = comm if comm is not None else default_communicator(dp_process_group)
        # [Note: two-level sharding]: the ranks holding the same shards.
        self._replicas = (
            default_communicator(replica_process_group)
            if replica_process_group is not None and dist.get_world_size(replica_process_group) > 1
            else None
        )
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.max_norm = float(max_norm)
        self.overlap_communication = overlap_communication
        self.cpu_offload = cpu_offload

        # The original parameters in the optimizer's order (state-dict indices).
        self._params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.dtype, self.device = _one_dtype_and_device(self._params)
        if self.dtype == torch.bfloat16:  # its own fp32 masters: no bf16 ones to round
            check_own_masters(optimizer, "LowLevelZeroOptimizer")
        self.scaler = DynamicLossScaler(loss_scale) if self.dtype == torch.float16 else None
        self._master_device = _HOST if cpu_offload else self.device
        # fp32 masters are the working pieces themselves unless offloaded.
        self._alias_master = self.dtype == torch.float32 and not cpu_offload

        self._build_layout(optimizer, reduce_bucket_size)
        self._init_norm(tp_process_group, model_parallel_groups, counts_toward_norm)
        self.inner = self._make_inner(optimizer)
        # Optimizer machinery (hooks, LR schedulers) works on this object;
        # param_groups and state are the inner optimizer's own.
        super().__init__([{"params": [torch.zeros(1)]}], dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults
        self._init_backward()

    # -- public view [Note: sharded optimizer interface] ------------------------------

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters in the original optimizer's param-group
        order, frozen ones included: index ``i`` is the parameter of
        state-dict index ``i``. (The param groups of this optimizer hold the
        fp32 masters instead.)"""
        return tuple(self._params)

    @property
    def group_indices(self) -> tuple[tuple[int, ...], ...]:
        """Per param group, the indices (into :attr:`params`) of its
        parameters, in the group's order."""
        return tuple(tuple(indices) for indices in self._group_indices)

    @property
    def masters_are_params(self) -> bool:
        """True when the fp32 masters are this rank's pieces of the working
        parameters themselves (fp32 parameters, no ``cpu_offload``): no
        separate full-precision copy exists, and :meth:`full_params` equals
        the model's parameters."""
        return self._alias_master

    @property
    def masters(self) -> tuple[torch.Tensor, ...]:
        """This rank's fp32 master pieces, one per bucket in :attr:`buckets`
        order: the tensors the wrapped optimizer steps (and keys its state
        by)."""
        return tuple(self._masters)

    @property
    def model_parallel_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups the squared gradient norm is summed over after the
        data-parallel ranks (``tp_process_group`` included)."""
        return self._norm_groups

    # -- construction -------------------------------------------------------------

    def _init_norm(
        self,
        tp_process_group: dist.ProcessGroup | None,
        model_parallel_groups: Sequence[dist.ProcessGroup],
        counts_toward_norm: Callable[[torch.Tensor], bool] | None,
    ) -> None:
        """Who the global norm is summed over, and what counts here."""
        self.tp_group = tp_process_group
        # Every group the squared norm is summed over after the data-parallel
        # ranks [Note: global norm across groups].
        self._norm_groups = tuple(norm_groups(model_parallel_groups, tp_process_group))
        if counts_toward_norm is None and tp_process_group is not None:
            counts_toward_norm = counts_under_tensor_parallel(tp_process_group)
        # Per bucket, the ranges of this rank's piece that count towards the
        # global norm; None: all of them.
        self._norm_ranges = (
            self._plan_norm_ranges(counts_toward_norm) if counts_toward_norm is not None else None
        )

    def _init_backward(self) -> None:
        """Backward bookkeeping, and the hooks that feed it."""
        self._no_sync = False
        self._arrived: dict[int, int] = {}  # bucket id -> gradients arrived this backward
        self._ready: set[int] = set()  # buckets complete, waiting their turn
        self._next = 0  # next bucket (in order) to launch this backward
        self._pending: list[tuple[Handle, Callable[[], None]]] = []
        # Stage 1: the gradient buffer holds gradients no reduction has seen
        # (set by no_sync, cleared by a synchronised backward). The same on
        # every rank, since every rank makes the same calls.
        self._need_reduce = True
        # Stage 1: (bucket, slot offset) whose gradient the flat buffer holds.
        self._accumulated: set[tuple[int, int]] = set()
        self._has_grad: set[int] = set()  # stage 2: shard piece holds a gradient
        self._staging: dict[int, torch.Tensor] = {}  # stage 2: this backward's buffers
        self._filled: dict[int, set[int]] = {}  # their slots written so far
        self._pool: list[torch.Tensor] = []  # free staging buffers [Note: staging]
        self._staging_whole: dict[int, torch.Tensor] = {}  # the pool buffer under each
        self._callback_queued = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_method(self._on_grad))  # type: ignore[no-untyped-call]
            for p in self._where
        ]

    def _build_layout(self, optimizer: Optimizer, bucket_numel: int) -> None:
        index = {id(p): i for i, p in enumerate(self._params)}
        # Each user group's parameters (frozen ones too), as state-dict indices.
        self._group_indices = [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        arrival = {id(p): k for k, p in enumerate(reversed(self._params))}
        groups = [
            [(index[id(p)], p.shape) for p in reversed(g["params"]) if p.requires_grad]
            for g in optimizer.param_groups
        ]
        # 8-bit moments are kept per block of 256: whole blocks per piece.
        multiple = 256 if self.optimizer_states is StateDtype.INT8 else 1
        planned = plan_buckets(groups, bucket_numel, self.world_size, multiple)
        buckets = [
            replace(b, order=max(arrival[id(self._params[s.index])] for s in b.slots))
            for group in planned
            for b in group
        ]
        # Launch order: by the arrival of each bucket's last gradient.
        self.buckets: list[Bucket] = sorted(buckets, key=lambda b: (b.order, b.group, b.start))
        self._where: dict[torch.Tensor, tuple[int, Slot]] = {}
        sizes = [sum(b.numel for b in group) for group in planned]
        # On the CPU with a shared-memory communicator, the flat buffers live
        # in its symmetric memory: reduce-scatter reads the gradients and
        # all-gather writes the parameters in place, with no staging copy.
        self._symmetric = isinstance(self.comm, SymmetricAllocator) and self.device == _HOST

        def buffer(n: int) -> torch.Tensor:
            if self._symmetric:
                return self.comm.alloc(n, self.dtype)  # type: ignore[attr-defined, no-any-return]
            return torch.zeros(n, dtype=self.dtype, device=self.device)

        self._flat_params = [buffer(n) for n in sizes]
        self._flat_grads = [buffer(n) for n in sizes] if self.stage == 1 else []
        # Where each bucket's piece sits in its group's gradient shard.
        self._piece_offset: dict[int, int] = {}
        shard_sizes = [0] * len(planned)
        for b in sorted(self.buckets, key=lambda b: (b.group, b.start)):
            self._piece_offset[id(b)] = shard_sizes[b.group]
            shard_sizes[b.group] += b.piece
        with torch.no_grad():
            for k, b in enumerate(self.buckets):
                flat = self._flat_params[b.group]
                for slot in b.slots:
                    param = self._params[slot.index]
                    view = flat[b.start + slot.offset : b.start + slot.offset + slot.numel]
                    view.copy_(param.detach().reshape(-1))
                    param.data = view.view(slot.shape)
                    self._where[param] = (k, slot)
        # Stage 2's persistent gradient shard (stage 1's is made per step).
        self._grad_shards: list[torch.Tensor | None] = [
            torch.zeros(n, dtype=self.dtype, device=self.device) if self.stage == 2 else None
            for n in shard_sizes
        ]
        self._shard_sizes = shard_sizes

    def _make_inner(self, optimizer: Optimizer) -> Optimizer:
        """The user's optimizer, now over this rank's master pieces."""
        self._masters: list[torch.Tensor] = []
        for b in self.buckets:
            piece = self._working_piece(b)
            if self._alias_master:
                master = piece
            else:
                pin = self._master_device.type == "cpu" and self.device.type == "cuda"
                master = torch.empty(
                    b.piece, dtype=torch.float32, device=self._master_device, pin_memory=pin
                )
                master.copy_(piece)
            self._masters.append(master)
        per_group: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for b, master in zip(self.buckets, self._masters, strict=True):
            per_group[b.group].append(master)
        narrow = self.optimizer_states is not StateDtype.FP32
        torch_adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        if torch_adam and (self.cpu_offload or narrow):
            # Steps on the host (cpu_offload) or where the masters are.
            on_host = self.cpu_offload or self._master_device.type == "cpu"
            return adam_storing(
                optimizer, self.optimizer_states, on_host=on_host, params=per_group, **self._disk
            )
        optimizer.state.clear()
        adam = torch_adam
        for g, ps in zip(optimizer.param_groups, per_group, strict=True):
            g["params"] = ps
            # Masters are dense fp32 on one device: torch's fused kernel fits
            # them and is several times faster than the default foreach path,
            # with the same update (to fp32 rounding). An explicit
            # foreach/fused choice is left alone.
            chosen = g.get("foreach") is not None or g.get("fused")
            special = g.get("differentiable") or g.get("capturable")
            if adam and not chosen and not special:
                g["fused"] = True
        return optimizer

    # -- views ----------------------------------------------------------------------

    def _grad_view(self, b: Bucket, slot: Slot) -> torch.Tensor:
        flat = self._flat_grads[b.group]
        start = b.start + slot.offset
        return flat[start : start + slot.numel].view(slot.shape)

    def _working_piece(self, b: Bucket) -> torch.Tensor:
        lo, hi = b.piece_range(self.rank)
        return self._flat_params[b.group][b.start + lo : b.start + hi]

    def _grad_piece(self, b: Bucket) -> torch.Tensor:
        shard = self._grad_shards[b.group]
        if shard is None:  # stage 1: made for this reduction, dropped after the step
            shard = torch.zeros(self._shard_sizes[b.group], dtype=self.dtype, device=self.device)
            self._grad_shards[b.group] = shard
        offset = self._piece_offset[id(b)]
        return shard[offset : offset + b.piece]

    # -- backward -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``loss.backward()``, scaled first when a loss scale is in use."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (stage 1)
        [Note: gradient accumulation]."""
        if self.stage == 2:
            raise RuntimeError(
                "no_sync() is not available with ZeRO stage 2: gradients are sharded as "
                "they arrive, so every backward communicates. Accumulate by calling "
                "backward on each micro-batch (the shard sums them), or use stage 1."
            )
        previous, self._no_sync = self._no_sync, True
        self._need_reduce = True
        try:
            yield
        finally:
            self._no_sync = previous

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        k, slot = self._where[param]
        b = self.buckets[k]
        grad = param.grad
        assert grad is not None
        if self.stage == 1:
            # Copied into the flat buffer (added, if it already holds this
            # parameter's gradient since zero_grad) and freed: cheaper than
            # zeroing the buffer and letting autograd add into views.
            view = self._grad_view(b, slot)
            if (k, slot.offset) in self._accumulated:
                view.add_(grad)
            else:
                view.copy_(grad)
                self._accumulated.add((k, slot.offset))
            param.grad = None
            if self._no_sync:
                return
        else:
            staging = self._staging_for(k)
            staging[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
            self._filled[k].add(slot.offset)
            param.grad = None
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        self._arrived[k] = self._arrived.get(k, 0) + 1
        if self._arrived[k] == len(b.slots):
            self._ready.add(k)
            if self.overlap_communication:
                while self._next in self._ready:
                    self._launch(self._next)
                    self._next += 1

    def _end_backward(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._arrived, self._ready, self._next = {}, set(), 0
        self._callback_queued = False
        self._need_reduce = False

    def _staging_for(self, k: int) -> torch.Tensor:
        """Stage 2: bucket ``k``'s staging buffer for this backward, from a
        pool (buffers return to it when their reduction completes)."""
        if k not in self._staging:
            b = self.buckets[k]
            fits = [i for i, buf in enumerate(self._pool) if buf.numel() >= b.numel]
            if fits:
                whole = self._pool.pop(min(fits, key=lambda i: self._pool[i].numel()))
            else:
                whole = torch.empty(b.numel, dtype=self.dtype, device=self.device)
            self._staging_whole[k] = whole
            buf = whole[: b.numel]
            end = b.slots[-1].offset + b.slots[-1].numel
            buf[end:].zero_()  # padding
            self._staging[k] = buf
            self._filled[k] = set()
        return self._staging[k]

    def _launch(self, k: int) -> None:
        """Start bucket ``k``'s averaged reduce-scatter into this rank's piece."""
        b = self.buckets[k]
        target = self._grad_piece(b)
        if self.stage == 1:
            source = self._flat_grads[b.group][b.start : b.start + b.numel]
            for slot in b.slots:  # no gradient here since zero_grad: zeros
                if (k, slot.offset) not in self._accumulated:
                    self._grad_view(b, slot).zero_()
                    self._accumulated.add((k, slot.offset))
            handle = self.comm.reduce_scatter(target, source, ReduceOp.AVG, async_op=True)
            self._pending.append((handle, lambda: None))
            return
        # Stage 2 keeps at most _MAX_IN_FLIGHT staging buffers busy, so its
        # transient gradient memory is a few buckets, not the whole model.
        while len(self._pending) >= _MAX_IN_FLIGHT:
            handle, finish = self._pending.pop(0)
            handle.wait()
            finish()
        source = self._staging_for(k)
        filled = self._filled.pop(k)
        for slot in b.slots:  # gradients that never arrived here are zeros
            if slot.offset not in filled:
                source[slot.offset : slot.offset + slot.numel].zero_()
        del self._staging[k]
        pool, whole = self._pool, self._staging_whole.pop(k)
        if k not in self._has_grad:
            self._has_grad.add(k)
            handle = self.comm.reduce_scatter(target, source, ReduceOp.AVG, async_op=True)

            def recycle() -> None:
                pool.append(whole)

            self._pending.append((handle, recycle))
            return
        received = torch.empty_like(target)
        handle = self.comm.reduce_scatter(received, source, ReduceOp.AVG, async_op=True)

        def accumulate(t: torch.Tensor = target, r: torch.Tensor = received) -> None:
            t.add_(r)
            pool.append(whole)

        self._pending.append((handle, accumulate))

    def _wait(self) -> None:
        for handle, finish in self._pending:
            handle.wait()
            finish()
        self._pending = []
        self._pool.clear()  # [Note: staging]

    # -- step -----------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (``set_to_none`` is accepted for torch's
        signature: parameters' ``.grad`` are always ``None`` here)."""
        self._wait()
        self._accumulated.clear()  # stage 1's buffer is overwritten, not zeroed
        if self.stage == 2:
            for shard in self._grad_shards:
                assert shard is not None
                shard.zero_()
            self._has_grad.clear()
            self._staging.clear()
            self._staging_whole.clear()
            self._filled.clear()
        else:
            self._need_reduce = True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step [Note: a step]. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self.step_gradients()
        try:
            ok = self._checks_pass(grads)
        except NonFiniteGradientError:
            self._end_step()  # nothing stepped; the next step starts afresh
            raise
        if not ok:
            self._end_step()
            return loss
        self.step_with(grads, 1.0)
        return loss

    # [Note: a step in two halves]
    # Optimizers stepped as one (the dense and the expert parts of an
    # expert-parallel model, pc_zero.step_together) need one global norm and
    # one overflow decision across them: each gives its gradients
    # (step_gradients) and their squared norm over its own ranks
    # (gradient_squares); the factor is decided once (step_factor); each
    # then steps with it (step_with) or skips (skip_step).

    def step_gradients(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient pieces for the step, reductions done
        [Note: a step in two halves]."""
        if self.stage == 1 and self._need_reduce:  # e.g. every backward ran under no_sync
            for k in range(len(self.buckets)):
                self._launch(k)
            self._need_reduce = False
        self._wait()
        if self._replicas is not None:  # [Note: two-level sharding]
            handles = [
                self._replicas.all_reduce(self._grad_piece(b), ReduceOp.AVG, async_op=True)
                for b in self.buckets
            ]
            for handle in handles:
                handle.wait()
        return [self._fp32_grad(b) for b in self.buckets]

    def gradient_squares(self, grads: list[torch.Tensor]) -> float:
        """The squared norm of ``grads`` (:meth:`step_gradients`) over every
        rank holding a piece of these parameters: the data-parallel ranks
        and the model-parallel groups, each parameter counted once."""
        return reduced_squares(
            grads, self.comm, self.device, self._norm_groups,
            count_ranges=self._norm_ranges, check_all=self.scaler is not None,
        )  # fmt: skip

    def step_with(self, grads: list[torch.Tensor], factor: float) -> None:
        """Step on ``grads`` times ``factor`` (unscaling and clipping), then
        gather the parameters [Note: a step in two halves]."""
        if factor != 1.0:
            for grad in grads:
                grad.mul_(factor)
        for master, grad in zip(self._masters, grads, strict=True):
            master.grad = grad
        self.inner.step()
        for master in self._masters:
            master.grad = None
        self._gather_params()
        if self.scaler is not None:
            self.scaler.update(False)
        self._end_step()

    def skip_step(self) -> None:
        """The step skipped on overflow, decided across the optimizers
        stepped as one: the loss scale backs off."""
        if self.scaler is not None:
            self.scaler.update(True)
        self._end_step()

    def _fp32_grad(self, b: Bucket) -> torch.Tensor:
        # fp32 on the same device: the piece itself, unscaled and clipped in
        # place, as torch's clip_grad_norm_ treats .grad.
        return self._grad_piece(b).to(self._master_device, torch.float32)

    def _checks_pass(self, grads: list[torch.Tensor]) -> bool:
        ok, _ = unscale_clip_and_check(
            grads,
            self.comm,
            self.scaler,
            self._step_max_norm(),
            self.device,
            count_ranges=self._norm_ranges,
            model_parallel_groups=self._norm_groups,
        )
        return ok

    def _plan_norm_ranges(
        self, counts: Callable[[torch.Tensor], bool]
    ) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of this rank's piece holding parameters
        that ``counts`` says count here towards the global norm."""
        ranges: list[list[tuple[int, int]]] = []
        for b in self.buckets:
            lo, hi = b.piece_range(self.rank)
            mine: list[tuple[int, int]] = []
            for slot in b.slots:
                if not counts(self._params[slot.index]):
                    continue
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < end:
                    mine.append((start - lo, end - lo))
            ranges.append(mine)
        return ranges

    def _gather_params(self) -> None:
        handles = []
        # An fp32 master is the piece itself: gathered in place where the
        # communicator allows it (symmetric memory), else from a copy.
        in_place = self._alias_master and self._symmetric
        for b, master in zip(self.buckets, self._masters, strict=True):
            mine = master if in_place else master.to(self.device, self.dtype, copy=True)
            full = self._flat_params[b.group][b.start : b.start + b.numel]
            handles.append(self.comm.all_gather(full, mine, async_op=True))
        for handle in handles:
            handle.wait()

    def _end_step(self) -> None:
        if self.stage == 1:
            self._grad_shards = [None] * len(self._grad_shards)
        self._step_clipped()

    # -- accounting ------------------------------------------------------------------

    def memory(self) -> ModelStateMemory:
        """Bytes of model states this rank holds now [Note: ZeRO memory]."""
        seen: set[int] = set()

        def size(tensors: list[torch.Tensor]) -> tuple[int, int]:
            total = host = 0
            for t in tensors:  # tensors, not storages: symmetric buffers share one
                nbytes = stored_bytes(t)
                # 8-bit moments are a wrapper: their codes' address names them.
                address = getattr(t, "codes", t).data_ptr()
                if address in seen or nbytes == 0:
                    continue
                seen.add(address)
                total += nbytes
                host += nbytes if t.device.type == "cpu" else 0
            return total, host

        params, h1 = size(self._flat_params)
        grads, h2 = size(self._flat_grads + [s for s in self._grad_shards if s is not None])
        master, h3 = size([] if self._alias_master else self._masters)
        states = [
            v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        optimizer_states, h4 = size(states)
        return ModelStateMemory(params, grads, master, optimizer_states, h1 + h2 + h3 + h4)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def remove_hooks(self) -> None:
        """Detach from the model's parameters (the optimizer is unusable after)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- checkpoints (pc_zero.state) ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in torch's per-parameter format (a
        collective: every rank calls it and gets the whole dict)."""
        self._wait()
        return full_state_dict(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, per parameter; merge every rank's
        with :func:`pc_zero.merge_sharded_state_dicts`."""
        self._wait()
        return sharded_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()``, from merged shards
        saved at any world size, or from a torch Adam/AdamW)."""
        plan = plan_load(self, state_dict)
        self._wait()
        if not self._alias_master:  # masters follow the (already loaded) model...
            for master, b in zip(self._masters, self.buckets, strict=True):
                master.copy_(self._working_piece(b))
        for k, master in plan.masters.items():  # ...unless the state holds them
            self._masters[k].copy_(master)
        self.inner.load_state_dict(plan.inner)
        if plan.masters:
            self._gather_params()
        if plan.loss_scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(plan.loss_scaler)
        # torch's load_state_dict swaps in new group and state objects; an
        # LR scheduler holding this optimizer must see them.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def owned_pieces(self) -> list[OwnedPiece]:
        """This rank's pieces of each trainable parameter, for sharded
        checkpoints: the parameter's index (state-dict order), where the
        piece starts in its flattened values, a view of the fp32 master
        piece and views of its element-wise optimizer states (a piece
        written in place is the master; call :meth:`sync_params` after)."""
        out = []
        for b, master in zip(self.buckets, self._masters, strict=True):
            lo, hi = b.piece_range(self.rank)
            state = self.inner.state[master]
            for key, value in list(state.items()):
                # Checkpoints hold fp32 moments, and 8-bit ones have no
                # element views: a checkpoint's pieces read and write an fp32
                # copy, stored narrow again at the next step (pc_offload
                # [Note: low-precision optimizer states]).
                if isinstance(value, torch.Tensor) and is_narrow(value):
                    state[key] = widen(value)
            for slot in b.slots:
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start >= end:
                    continue
                views = {
                    key: value[start - lo : end - lo]
                    for key, value in state.items()
                    if isinstance(value, torch.Tensor) and value.shape == master.shape
                }
                out.append(
                    OwnedPiece(
                        slot.index, start - slot.offset, master[start - lo : end - lo], views, state
                    )
                )
        return out

    def init_state(self, elementwise: Sequence[str], scalars: Mapping[str, Any]) -> None:
        """Give every master piece without optimizer state the entries
        ``elementwise`` (zeros shaped like it) and ``scalars``, so a sharded
        load has state to fill before the first step."""
        for master in self._masters:
            if not self.inner.state.get(master):
                entry: dict[str, Any] = {key: torch.zeros_like(master) for key in elementwise}
                entry.update(
                    {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}
                )
                self.inner.state[master] = entry

    def sync_params(self) -> None:
        """Every rank's parameters from the masters (collective): after the
        masters were written in place."""
        self._wait()
        self._gather_params()

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """Stage 1, between ``no_sync`` backwards and ``step``: the gradient
        accumulated locally for ``param`` (a view to modify in place, for
        example to sum a weight tied across pipeline stages). A parameter
        that received none yet gets zeros, counted as received."""
        if self.stage != 1:
            raise ValueError(
                "accumulated_grad is for stage 1, whose full gradients wait in a local "
                "buffer under no_sync; stage 2 keeps only its shard."
            )
        if param not in self._where:
            raise ValueError("this parameter is not in the optimizer (or does not require grad).")
        k, slot = self._where[param]
        view = self._grad_view(self.buckets[k], slot)
        if (k, slot.offset) not in self._accumulated:
            view.zero_()
            self._accumulated.add((k, slot.offset))
        self._need_reduce = True
        return view

    # -- full-precision parameters ------------------------------------------------------

    def full_params(self) -> dict[int, torch.Tensor]:
        """Every trainable parameter at full precision, by its index in the
        original optimizer's order: the fp32 masters gathered (collective),
        on the host. With fp16/bf16 parameters these are the values the
        optimizer steps, which the model's copies only round."""
        out: dict[int, torch.Tensor] = {}
        for b, master in zip(self.buckets, self._masters, strict=True):
            full = torch.empty(b.numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, master.to(self.device, torch.float32))
            for slot in b.slots:
                value = full[slot.offset : slot.offset + slot.numel]
                out[slot.index] = value.view(slot.shape).cpu().clone()
        return out

    def load_full_params(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set parameters from full values (index in the original order ->
        tensor; every rank passes the same): the masters take them at full
        precision and the model's parameters their rounding. Use it to load
        weights into a model whose optimizer keeps separate masters (fp16,
        bf16, ``cpu_offload``); writing the model's parameters alone would
        be undone by the next step."""
        for b, master in zip(self.buckets, self._masters, strict=True):
            lo, hi = b.piece_range(self.rank)
            for slot in b.slots:
                value = values.get(slot.index)
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if value is None or start >= end:
                    continue
                if value.numel() != slot.numel:
                    raise ValueError(
                        f"parameter {slot.index}: got {value.numel()} values for a parameter "
                        f"of shape {tuple(slot.shape)}."
                    )
                flat = value.reshape(-1).to(master.device, master.dtype)
                master[start - lo : end - lo].copy_(flat[start - slot.offset : end - slot.offset])
        self._gather_params()
