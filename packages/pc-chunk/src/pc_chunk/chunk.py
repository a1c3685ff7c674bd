"""A chunk: one flat buffer holding several parameters, sharded across ranks.

[Note: chunk states]
    FREE            only this rank's shard exists; the parameters are empty
    HOLD            the full payload is gathered and the parameters view it,
                    but no operator is using it: it may be released
    COMPUTE         an operator (forward or backward of a module) uses it
    HOLD_AFTER_FWD  forward is done with it; backward will need it again
    HOLD_AFTER_BWD  backward is done with it; its gradients are complete and
                    wait for the reduce-scatter

    FREE --gather--> HOLD --access--> COMPUTE --done(fwd)--> HOLD_AFTER_FWD
    HOLD_AFTER_FWD --access--> COMPUTE --done(bwd)--> HOLD_AFTER_BWD
    HOLD_AFTER_BWD --reduce_scatter_grads--> HOLD --release--> FREE

A chunk in COMPUTE or HOLD_AFTER_BWD cannot be released (an operator reads
it, or its gradients are not reduced yet); every illegal transition raises.
The Gemini design (docs/packages/pc-chunk.md) uses this set because each state
answers a placement question: FREE and HOLD* chunks are eviction
candidates, COMPUTE ones are pinned, and HOLD_AFTER_BWD marks gradients
that are ready to be reduced.

[Note: shards]
With N ranks, chunk size C is a multiple of N and rank r owns elements
[r C/N, (r + 1) C/N): its shard, the only copy that persists. ``gather``
all-gathers the shards into the payload; ``release`` drops it.
``reduce_scatter_grads`` packs the parameters' gradients into one flat
buffer (in ``reduce_dtype``, fp32 by default, so a bf16 model still sums in
fp32), reduce-scatters it, and keeps this rank's part as an fp32 gradient
shard for the optimizer. ``set_shard`` writes updated master values back.
With a ``replica_comm`` (two-level sharding: the chunk is sharded over
``comm``, a node's ranks, and replicated over ``replica_comm``, the ranks
holding the same shard on other nodes) the reduced shard is then
all-reduced over the replicas with the same op, so it is the gradient
over every rank while each shard's bytes cross the slow links once.

[Note: exposed shards]
With ``expose_shard=True`` (what ZeRO-3 wrappers use) a released chunk
does not leave its parameters empty: each parameter views the part of this
rank's shard that falls inside it, flattened (possibly zero elements), and
its ``.grad`` views the same part of the gradient shard. Any torch
optimizer built over the parameters then steps the shard in place, with
its fp32 gradient shard: so an exposed shard is an fp32 master
(``shard_dtype`` fp32, the default with ``expose_shard``), whatever dtype
the parameters were built in. A bf16 or fp16 parameter is upcast exactly
as it is packed (``append``): its built values only initialise the master.
The payload's dtype (the compute dtype) is separate; ``gather`` casts the
shard to it. Gradients are
*added* into the gradient shard, so several backward passes accumulate.
While a chunk is gathered its parameters' ``.grad`` are set aside (None,
so autograd can accumulate full-shape gradients); a parameter whose
``.grad`` the user set to None, or zeroed, has that part of the gradient
shard zeroed, or the whole shard dropped when all are None.

Every byte a chunk holds on the compute device (payload, shard, gradient
shard) is reserved in a :class:`~pc_chunk.budget.DeviceBudget` when given,
which refuses to exceed its limit.

[Note: one payload storage]
Autograd keeps what forward saved for backward: a linear layer saves
``weight.t()``, a view of the payload that is not the parameter, so
re-pointing the parameter at release leaves the old payload alive. With
every chunk released after its module's forward, the whole gathered model
stayed alive until backward (the forward peak of ZeRO-3 was that of
unsharded training). So a release frees the payload's storage in place
(``untyped_storage().resize_(0)``): its bytes are given back while the
saved views keep a storage of size 0, and the next gather of the chunk
resizes that same storage and all-gathers into it, so in backward the
saved views read the gathered values again. Backward re-gathers a chunk
(its module's pre-backward hook) before any of its operators runs; a view
read while its chunk is released would fail loudly (its storage is empty),
never read stale values. As FSDP2 does after forward. Every payload starts
its storage (a trimmed one is the head of a longer storage, freed whole);
one that did not would be dropped as before, not freed in place.

[Note: host buffers]
A shard kept on the host, and its gradient shard, live for the whole run:
each is one exactly sized host tensor, pinned when the copy engine pins
(CUDA; pc_offload.pinned_empty, which does not round up to a power of two
as torch's pinned allocator does), allocated once. The gradient shard's
buffer is reused by every later step's copy down. They do not come from
the engine's pool: its size classes round up to powers of two (up to
twice the bytes) and its bound is for short-lived buffers (accumulation
scratch, activation offload). With ``keep_host_grad=False`` (an optimizer
that steps each chunk as soon as its gradients are reduced, so only one or
two gradient shards exist at a time) the gradient shard is such a
short-lived buffer instead, given back when it is cleared: no host
gradient memory is kept between steps. A prefetch of a host shard by a
single rank copies it up on the engine's side stream, so the copy overlaps the compute
before it (its device bytes reserved in the budget meanwhile); the cast to
the compute dtype waits until the chunk is used. With several ranks the
prefetch copies up on the current stream and starts the all-gather at once,
as for a device shard: every rank issues its collectives in the same order
whatever its placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from pc_chunk.budget import DeviceBudget
from pc_comm import Communicator, Handle, ReduceOp
from pc_offload import CopyEngine, Transfer, pinned_empty

__all__ = ["Chunk", "ChunkState", "ChunkStateError"]


class ChunkState(Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


class ChunkStateError(RuntimeError):
    """An operation that the chunk's state does not allow."""


@dataclass(frozen=True)
class _Slot:
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


_EMPTY_CACHE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _EMPTY_CACHE:
        _EMPTY_CACHE[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY_CACHE[key]


class Chunk:
    """``size`` elements of ``dtype`` on ``device``, sharded over ``comm``
    [Note: shards], moving through [Note: chunk states]."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        *,
        comm: Communicator | None = None,
        device: torch.device | str = "cpu",
        budget: DeviceBudget | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        engine: CopyEngine | None = None,
        name: str = "chunk",
        shard_dtype: torch.dtype | None = None,
        expose_shard: bool = False,
        replica_comm: Communicator | None = None,
    ) -> None:
        self.engine = engine  # host <-> device moves through pc-offload's pinned pool
        self.replica_comm = replica_comm  # [Note: shards]: two-level sharding
        self.world_size = comm.world_size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        if size <= 0 or size % self.world_size:
            raise ValueError(
                f"chunk size must be a positive multiple of the world size "
                f"({self.world_size}); got {size}."
            )
        self.size = size
        self.dtype = dtype
        self.comm = comm
        self.device = torch.device(device)
        self.budget = budget
        self.reduce_dtype = reduce_dtype
        self.name = name
        if shard_dtype is None:  # [Note: exposed shards]: fp32 masters
            shard_dtype = torch.float32 if expose_shard else dtype
        if expose_shard and shard_dtype != torch.float32:
            raise ValueError(
                f"{name}: an exposed shard is an fp32 master, stepped with its fp32 gradient "
                f"shard; shard_dtype must be torch.float32, got {shard_dtype}."
            )
        self.shard_dtype = shard_dtype
        self.expose_shard = expose_shard  # [Note: exposed shards]
        self.slots: list[_Slot] = []
        self.used = 0
        self.closed = False
        self.shard_size = size // self.world_size
        self._held_bytes = 0  # payload bytes reserved in the budget
        # A released payload whose storage was freed in place, filled again
        # by the next gather [Note: one payload storage].
        self._spare: torch.Tensor | None = None
        # While packing, the payload holds the parameters' own values in the
        # shard dtype, so fp32 masters are cut from unrounded values.
        self.payload: torch.Tensor | None = self._new_payload(self.shard_dtype)
        self.shard: torch.Tensor | None = None
        self.shard_on_device = False
        self.grad_shard: torch.Tensor | None = None
        self.state = ChunkState.HOLD
        self.users = 0  # operators between access() and done()
        self._gathering: Handle | None = None  # an all-gather in flight (prefetch)
        self._gather_source: torch.Tensor | None = None  # kept alive while it runs
        self._uploading: Transfer | None = None  # a host shard's prefetch copy to the device
        self._host_grad: torch.Tensor | None = None  # [Note: host buffers]
        self.keep_host_grad = True  # [Note: host buffers]
        self._grads_set_aside = False  # [Note: exposed shards]
        # The parameters that got a gradient since the last clear_grad
        # (None: all of them); the next reduction's, until it finishes.
        # [Note: a chunk without gradients] in pc_chunk.manager.
        self._grad_params: set[nn.Parameter] | None = None
        self._incoming_params: set[nn.Parameter] | None = None
        self._params_on_payload = True  # parameters view the payload (not the shard)
        self.gathers = 0  # all-gathers issued, for tests and statistics
        # A reduce-scatter in flight: (handle, input, output, reserved bytes).
        self._reducing: tuple[Handle | None, torch.Tensor, torch.Tensor, int] | None = None
        self._reduce_op = ReduceOp.AVG  # the one in flight, for the replicas

    def __repr__(self) -> str:
        return (
            f"Chunk({self.name}, size={self.size}, used={self.used}, "
            f"params={len(self.slots)}, state={self.state.value})"
        )

    @property
    def payload_bytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def shard_bytes(self) -> int:
        return self.shard_size * self.shard_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Device bytes ``reduce_scatter_grads`` needs at its peak."""
        grad_shard = 0 if self.grad_shard is not None or not self.shard_on_device else 4
        return self.size * self.reduce_dtype.itemsize + self.shard_size * grad_shard

    def _reserve(self, nbytes: int, what: str) -> None:
        if self.budget is not None:
            self.budget.reserve(nbytes, f"{self.name} {what}")

    def _free(self, nbytes: int, what: str) -> None:
        if self.budget is not None:
            self.budget.free(nbytes, f"{self.name} {what}")

    def _new_payload(self, dtype: torch.dtype, *, zeroed: bool = True) -> torch.Tensor:
        """A payload buffer; ``zeroed=False`` when the caller overwrites every
        element (a gather), which saves a pass over the whole chunk. The
        storage of the last released payload is reused when it fits
        [Note: one payload storage]."""
        nbytes = self.size * dtype.itemsize
        self._reserve(nbytes, "payload")
        self._held_bytes = nbytes
        spare, self._spare = self._spare, None
        if spare is not None and spare.dtype == dtype and spare.numel() == self.size:
            spare.untyped_storage().resize_(nbytes)
            return spare.zero_() if zeroed else spare
        if zeroed:
            return torch.zeros(self.size, dtype=dtype, device=self.device)
        return torch.empty(self.size, dtype=dtype, device=self.device)

    def _drop_payload(self, *, in_place: bool = False) -> None:
        """Drop the payload; ``in_place``: free its storage itself, which
        tensors saved for backward may still view, and keep it for the next
        gather [Note: one payload storage]."""
        payload, self.payload = self.payload, None
        if in_place and payload is not None and payload.storage_offset() == 0:
            payload.untyped_storage().resize_(0)
            self._spare = payload
        self._free(self._held_bytes, "payload")
        self._held_bytes = 0

    # -- filling -------------------------------------------------------------

    def can_fit(self, param: torch.Tensor) -> bool:
        return not self.closed and self.used + param.numel() <= self.size

    def append(self, param: nn.Parameter) -> None:
        """Move ``param`` into the chunk: its data becomes a view of the
        payload, in the shard dtype. A parameter built in a narrower floating
        dtype (bf16 or fp16 into fp32 masters) is upcast exactly; one the
        shard dtype cannot hold exactly is refused."""
        if self.closed:
            raise ChunkStateError(f"{self.name} is closed; parameters go in before close().")
        exact = param.is_floating_point() and (
            torch.promote_types(param.dtype, self.shard_dtype) == self.shard_dtype
        )
        if not exact:
            raise ValueError(
                f"{self.name} holds {self.shard_dtype}; the parameter is {param.dtype}, which "
                f"{self.shard_dtype} cannot hold exactly. Cast the model to {self.shard_dtype} "
                "(or a narrower floating dtype) first."
            )
        numel = param.numel()
        if self.used + numel > self.size:
            raise ValueError(
                f"{self.name} has {self.size - self.used} free elements; the parameter needs "
                f"{numel}."
            )
        assert self.payload is not None
        view = self.payload[self.used : self.used + numel]
        view.copy_(param.detach().reshape(-1))
        slot = _Slot(param, self.used, numel, param.shape)
        self.slots.append(slot)
        self.used += numel
        param.data = view.view(slot.shape)

    def close(
        self, *, shard_on_device: bool = True, release: bool = False, trim: bool = False
    ) -> None:
        """No more parameters: cut this rank's shard out of the payload and
        keep it on the device or the host; ``release`` drops the payload at
        once (before the shard is reserved, so a tight budget suffices).
        ``trim`` shrinks the chunk to the elements it uses, rounded up to a
        multiple of the world size: the chunk size decided which parameters
        share a chunk, the padding after them is not kept."""
        if self.closed:
            return
        assert self.payload is not None
        size = -(-max(self.used, 1) // self.world_size) * self.world_size
        if trim and size < self.size:
            freed = (self.size - size) * self.payload.element_size()
            self.payload = self.payload[:size] if release else self.payload[:size].clone()
            self._free(freed, "payload")
            self._held_bytes -= freed
            self.size, self.shard_size = size, size // self.world_size
            if not release:
                self._point_params()
        lo = self.rank * self.shard_size
        mine = self.payload[lo : lo + self.shard_size]
        self.shard = mine.clone() if shard_on_device else self._move(mine, False)
        self.closed = True
        self.shard_on_device = shard_on_device
        if release:
            self.release()
        elif self.shard_dtype != self.dtype:  # the packing payload becomes a compute one
            full = self.payload.to(self.dtype)
            self._drop_payload()
            self.payload = self._new_payload(self.dtype, zeroed=False)
            self.payload.copy_(full)
            self._point_params()
        if shard_on_device:
            self._reserve(self.shard_bytes, "shard")

    # -- residency -------------------------------------------------------------

    def _shard_part(self, slot: _Slot, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (shard-sized) that lies inside ``slot``."""
        lo = self.rank * self.shard_size
        start = min(max(slot.offset, lo), lo + self.shard_size)
        end = max(min(slot.offset + slot.numel, lo + self.shard_size), start)
        return tensor[start - lo : end - lo]

    def shard_parts(self) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
        """For each parameter: its flat start offset, and the part of this
        rank's shard inside it ([Note: exposed shards]); parts may be empty."""
        assert self.shard is not None
        lo = self.rank * self.shard_size
        return [
            (slot.param, max(lo - slot.offset, 0), self._shard_part(slot, self.shard))
            for slot in self.slots
        ]

    def _point_params(self) -> None:
        self._params_on_payload = self.payload is not None
        for slot in self.slots:
            if self.payload is not None:
                if self.expose_shard:
                    slot.param.grad = None  # a full-shape view cannot keep a flat gradient
                view = self.payload[slot.offset : slot.offset + slot.numel]
                slot.param.data = view.view(slot.shape)
            elif self.expose_shard and self.shard is not None:
                slot.param.data = self._shard_part(slot, self.shard)
                if self.grad_shard is not None:
                    got = self._grad_params is None or slot.param in self._grad_params
                    slot.param.grad = self._shard_part(slot, self.grad_shard) if got else None
            else:
                slot.param.data = _empty(self.dtype, self.device)

    def repoint(self) -> None:
        """Point the parameters at the payload, or (released) at the shard
        again, after something else borrowed them (``summon_full_params``)."""
        self._point_params()

    def _set_grads_aside(self) -> None:
        """Before the first gather of a step: what the user did to the
        exposed ``.grad`` decides what the gradient shard keeps."""
        self.finish_reduce()
        if not self.expose_shard or self._grads_set_aside:
            return
        self._grads_set_aside = True
        if self.grad_shard is None:
            return
        dropped = [slot for slot in self.slots if slot.param.grad is None]
        if len(dropped) == len(self.slots):
            self.clear_grad()
            return
        for slot in dropped:
            self._shard_part(slot, self.grad_shard).zero_()
        if self._grad_params is None:
            self._grad_params = {slot.param for slot in self.slots}
        self._grad_params -= {slot.param for slot in dropped}

    def _shard_for_compute(self) -> torch.Tensor:
        assert self.shard is not None
        if self.shard.device == self.device:
            return self.shard
        return self.shard.to(self.device, non_blocking=True)

    def gather(self, *, async_op: bool = False) -> None:
        """FREE -> HOLD: all-gather the shards into a full payload. With
        ``async_op`` the all-gather is only started (a prefetch); the next
        ``gather()``, ``access()`` or ``release()`` completes it."""
        self._need_closed("gather")
        if self.state is not ChunkState.FREE:
            if not async_op:
                self._finish_gather()
            return
        self._set_grads_aside()
        self.payload = self._new_payload(self.dtype, zeroed=False)  # the gather fills it
        self.state = ChunkState.HOLD
        self.gathers += 1
        shard = self.shard
        assert shard is not None
        if (
            async_op
            and self.comm is None
            and self.engine is not None
            and self.device.type == "cuda"
            and shard.device.type == "cpu"
            and (self.budget is None or self.budget.available_bytes >= self.shard_bytes)
        ):
            # One rank's prefetch of a host shard: its copy to the device
            # runs on the copy engine's side stream, overlapping compute; the
            # cast follows when the chunk is needed (_finish_gather). Not with
            # several ranks: deferring the all-gather would make the order of
            # collectives depend on this rank's placement.
            self._reserve(self.shard_bytes, "upload")
            self._uploading = self.engine.to_device(shard, self.device)
            return
        self._gather_from(self._shard_for_compute(), async_op)

    def _gather_from(self, shard: torch.Tensor, async_op: bool) -> None:
        assert self.payload is not None
        if shard.dtype != self.dtype:
            shard = shard.to(self.dtype)
        if self.comm is None:
            self.payload.copy_(shard)
        else:
            self._gathering = self.comm.all_gather(self.payload, shard, async_op=async_op)
            self._gather_source = shard
        if async_op:
            return
        self._finish_gather()

    def _finish_gather(self) -> None:
        if self._uploading is not None:
            shard = self._uploading.wait()
            self._uploading = None
            self._gather_from(shard, async_op=False)  # finishes the gather
            del shard
            self._free(self.shard_bytes, "upload")
            return
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
        self._gather_source = None
        if not self._params_on_payload:
            self._point_params()

    def release(self) -> None:
        """HOLD / HOLD_AFTER_FWD -> FREE: drop the payload (the shard stays)."""
        self._need_closed("release")
        if self.state is ChunkState.FREE:
            return
        if self.state in (ChunkState.COMPUTE, ChunkState.HOLD_AFTER_BWD):
            raise ChunkStateError(
                f"{self.name} cannot be released in state {self.state.value}: "
                + (
                    "an operator is using it."
                    if self.state is ChunkState.COMPUTE
                    else "its gradients are not reduced yet (call reduce_scatter_grads)."
                )
            )
        if self._gathering is not None:  # a prefetch still writing into the payload
            self._gathering.wait()
            self._gathering = None
            self._gather_source = None
        if self._uploading is not None:  # its device memory lives until the copy is done
            self._uploading = None
            self._free(self.shard_bytes, "upload")
        self._drop_payload(in_place=True)
        self._point_params()
        self.state = ChunkState.FREE
        self._grads_set_aside = False

    def note_gradients(self, params: set[nn.Parameter]) -> None:
        """Before ``reduce_scatter_grads``: which parameters got a gradient.
        The others' exposed ``.grad`` stays None, so an optimizer skips them
        as it would in single-process training [Note: a chunk without
        gradients]. Without this call every parameter counts as having one."""
        # All of them (the usual case) is None, as in _grad_params.
        self._incoming_params = None if len(params) == len(self.slots) else set(params)

    def abandon(self) -> None:
        """End every use of a gathered chunk that produced no gradient (a
        module that ran, or got a backward pre-hook, but no gradient for its
        parameters): -> HOLD, so it can be released."""
        if self.state in (ChunkState.COMPUTE, ChunkState.HOLD_AFTER_FWD):
            self.users = 0
            self.state = ChunkState.HOLD

    def access(self) -> None:
        """-> COMPUTE, gathering first if needed. Several operators may use
        a chunk at once; each access() is matched by one done()."""
        self.gather()
        self.users += 1
        self.state = ChunkState.COMPUTE

    def done(self, phase: str) -> None:
        """COMPUTE -> HOLD_AFTER_FWD (``phase="forward"``) or HOLD_AFTER_BWD,
        once the last user is done."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}.")
        if phase == "backward":  # gradients complete: every user is done
            if self.state is ChunkState.FREE:
                raise ChunkStateError(f"{self.name}: done('backward') on a released chunk.")
            self.users = 0
            self.state = ChunkState.HOLD_AFTER_BWD
            return
        if self.state is not ChunkState.COMPUTE or self.users == 0:
            raise ChunkStateError(f"{self.name}: done() in state {self.state.value}, not compute.")
        self.users -= 1
        if self.users == 0:
            self.state = ChunkState.HOLD_AFTER_FWD

    def move_shard(self, to_device: bool) -> None:
        """Keep this rank's shard (and its gradient shard) on the compute
        device or on the host, with the budget accounting the move."""
        self.finish_reduce()
        self._need_closed("move_shard")
        if to_device == self.shard_on_device:
            return
        assert self.shard is not None
        nbytes = self.shard_bytes + (
            self.grad_shard.numel() * 4 if self.grad_shard is not None else 0
        )
        if to_device:
            self._reserve(nbytes, "shard")
        self.shard = self._move(self.shard, to_device)
        if self.grad_shard is not None:
            self.grad_shard = self._move(self.grad_shard, to_device)
        self._host_grad = None if to_device or not self.keep_host_grad else self.grad_shard
        if not to_device:
            self._free(nbytes, "shard")
        self.shard_on_device = to_device
        if self.payload is None and self.expose_shard:
            self._point_params()  # the parameters view the moved shard

    def _move(
        self, tensor: torch.Tensor, to_device: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A copy on the device, or in a long-lived host buffer (``out``, or a
        new one) [Note: host buffers]; through the copy engine when there is one."""
        if to_device:
            if self.engine is None:
                return tensor.to(self.device, copy=True)
            transfer = self.engine.to_device(tensor, self.device)
            moved = transfer.wait()
            if self.engine.pool.owns(tensor):
                self.engine.release_after(transfer, tensor)
            else:
                transfer.synchronize()  # the host buffer may be freed next
            return moved
        if out is None:
            pinned = self.engine is not None and self.engine.pool.pinned
            out = (
                pinned_empty(tensor.shape, tensor.dtype)
                if pinned
                else torch.empty(tensor.shape, dtype=tensor.dtype)
            )
        if self.engine is None:
            return out.copy_(tensor)
        return self.engine.to_host(tensor, out=out).wait()

    def _to_host_scratch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A short-lived host copy: a pool buffer, given back with _drop."""
        if self.engine is None:
            return tensor.to("cpu", copy=True)
        return self.engine.to_host(tensor).wait()

    def _drop(self, tensor: torch.Tensor | None) -> None:
        """Give a host buffer back to the pool, if it came from there."""
        if tensor is not None and self.engine is not None and self.engine.pool.owns(tensor):
            self.engine.pool.release(tensor)

    # -- gradients and updates -------------------------------------------------

    def reduce_scatter_grads(
        self, op: ReduceOp = ReduceOp.AVG, *, async_op: bool = False
    ) -> torch.Tensor | None:
        """HOLD_AFTER_BWD (or any gathered state) -> HOLD: reduce the
        parameters' gradients across ranks; this rank keeps its part as an
        fp32 gradient shard. Parameters' ``.grad`` are cleared. With
        ``async_op`` the reduce-scatter runs in the background (the chunk
        may be released meanwhile) and :meth:`finish_reduce` completes it;
        returns the gradient shard, or None while it is in flight."""
        self._need_closed("reduce_scatter_grads")
        if self.state is ChunkState.FREE:
            raise ChunkStateError(f"{self.name}: gradients need the chunk gathered.")
        self.finish_reduce()
        flat_bytes = self.size * self.reduce_dtype.itemsize
        self._reserve(flat_bytes, "gradient buffer")
        # Every element is written once, with no zero-fill pass first: the
        # parameters lie back to back from offset 0 (append), so what is not
        # a gradient is a parameter without one or the padding after them.
        flat = torch.empty(self.size, dtype=self.reduce_dtype, device=self.device)
        for slot in self.slots:
            part = flat[slot.offset : slot.offset + slot.numel]
            grad = slot.param.grad
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad.reshape(-1))
                slot.param.grad = None
        flat[self.used :].zero_()
        out = torch.empty(self.shard_size, dtype=self.reduce_dtype, device=self.device)
        handle: Handle | None = None
        if self.comm is None:
            out.copy_(flat)  # one rank: the sum and the average are the gradient itself
        else:
            handle = self.comm.reduce_scatter(out, flat, op, async_op=async_op)
        self.state = ChunkState.HOLD
        self._reducing = (handle, flat, out, flat_bytes)
        self._reduce_op = op
        if async_op:
            return None
        self.finish_reduce()
        return self.grad_shard

    @property
    def held_grad(self) -> torch.Tensor | None:
        """The gradient memory this chunk holds: the gradient shard, or,
        between steps, the host buffer kept for the next one [Note: host
        buffers]."""
        return self.grad_shard if self.grad_shard is not None else self._host_grad

    @property
    def reducing(self) -> bool:
        """A reduce-scatter started with ``async_op=True`` is not finished."""
        return self._reducing is not None

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and add its result
        into the gradient shard."""
        if self._reducing is None:
            return
        handle, flat, out, flat_bytes = self._reducing
        self._reducing = None
        if handle is not None:
            handle.wait()
        if self.replica_comm is not None:  # [Note: shards]: across the replicas too
            self.replica_comm.all_reduce(out, self._reduce_op).wait()
        del flat
        self._free(flat_bytes, "gradient buffer")
        grad_shard = out if out.dtype == torch.float32 else out.float()
        accumulate = self.expose_shard and self.grad_shard is not None
        incoming, self._incoming_params = self._incoming_params, None
        if not accumulate:
            self._grad_params = incoming
        elif self._grad_params is not None and incoming is not None:
            self._grad_params |= incoming
        else:
            self._grad_params = None  # every parameter has one
        if not self.shard_on_device:
            if accumulate or not self.keep_host_grad:
                grad_shard = self._to_host_scratch(grad_shard)
            else:  # into the host buffer of earlier steps [Note: host buffers]
                free = self.grad_shard is None or self.grad_shard is self._host_grad
                reuse = self._host_grad if free else None
                grad_shard = self._move(grad_shard, False, out=reuse)
                self._host_grad = grad_shard
        if accumulate:
            assert self.grad_shard is not None
            self.grad_shard.add_(grad_shard)
            self._drop(grad_shard)
            if self.state is ChunkState.FREE:
                self._point_params()  # parameters with a first gradient now
        else:
            if self.grad_shard is None and self.shard_on_device:
                self._reserve(grad_shard.numel() * 4, "grad shard")
            if self.grad_shard is not grad_shard:
                self._drop(self.grad_shard)
            self.grad_shard = grad_shard
            if self.expose_shard and self.state is ChunkState.FREE:
                self._point_params()  # released meanwhile: .grad views the new shard

    def clear_grad(self) -> None:
        """Drop the gradient shard (after the optimizer consumed it)."""
        self.finish_reduce()
        if self.grad_shard is not None and self.shard_on_device:
            self._free(self.grad_shard.numel() * 4, "grad shard")
        self._drop(self.grad_shard)
        self.grad_shard = None
        self._grad_params = None

    def set_shard(self, values: torch.Tensor) -> None:
        """Write updated master values (this rank's shard) into the chunk,
        and into the payload if it is gathered."""
        self.finish_reduce()
        self._need_closed("set_shard")
        assert self.shard is not None
        if self._uploading is not None:  # a prefetch is copying the old values up
            self._uploading.synchronize()
            self.release()
        self.shard.copy_(values)
        if self.payload is not None:
            lo = self.rank * self.shard_size
            self.payload[lo : lo + self.shard_size].copy_(values)
            # Other ranks' parts of a held payload are stale until regathered.
            if self.world_size > 1 and self.state is not ChunkState.COMPUTE:
                self.release()

    def _need_closed(self, what: str) -> None:
        if not self.closed:
            raise ChunkStateError(f"{self.name}: {what}() before close().")
