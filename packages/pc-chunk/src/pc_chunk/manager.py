"""The chunk manager: packs a module's parameters into chunks in execution
order, places them, and drives their states through forward and backward.

[Note: execution order]
``execution_order(module, *inputs)`` runs one forward pass without
gradients, with a pre-hook on every module that records its own parameters
the first time it runs. Parameters packed in that order put what one block
uses into one chunk, so one gather serves the whole block. Parameters the
pass never touched follow in module order; without example inputs, module
order is used throughout. A parameter shared by two modules (tied
embeddings) is packed once, where it is first used.

[Note: driving a step]
``attach()`` installs hooks: before a module's forward, the chunks holding
its parameters are accessed (gathered); after it, they are released again,
so only the chunks of the running module (and those the placement keeps)
are full. Before a module's backward they are gathered again; when every
gradient of a chunk has been accumulated, its gradients are reduce-scattered
into an fp32 shard and the payload is released. A callback at the end of
backward finishes chunks some of whose parameters got no gradient. This is
what ZeRO-3 does; pc-zero builds its optimizer on top.

[Note: releasing and prefetching]
A chunk is not released the moment a module's forward is done with it: it
waits until the next module that does not need it starts (or the root
module's forward ends), so the modules sharing a chunk (a block's attention
and MLP) cost one gather, not one each. Inside backward nothing is released
after a forward: that forward is activation-checkpoint recomputation, and
backward needs the same chunk next; the chunk goes when its gradients are
reduced. A chunk a forward needs again after releasing it is kept through
later forwards when it holds a tied weight (used by the first and the last
module); any other is gathered again. (A chunk revisited only because the
modules' order of registration is not the order they run in, as a Llama
block's norms registered after its MLP, used to be kept too: with chunks of
a few blocks every chunk was, and the whole model stayed gathered from the
first module to the end of the forward, 4 bytes per parameter at any world
size: benchmarks/bench_state_tiers.py.)
With ``reshard_after_forward=False`` chunks stay gathered from
forward until their gradients are reduced (ZeRO-2-like). The first step
records the order in which chunks get gathered in forward and in backward
(recomputation counts as backward); later steps follow that list with a
cursor and start the all-gather of the next chunk on it while the current
one computes (``prefetch``), when the budget has room for it.

[Note: overlapped reduction]
A chunk's reduce-scatter starts when its last gradient arrives and runs in
the background while backward goes on; the one before it is finished
(waited for and added into its gradient shard) then, so one is in flight
at a time, and the end-of-backward callback finishes the last. Under a
device budget the previous one is finished first, so its buffer is free
before the next is reserved. ``on_reduced(chunk)``, when set, runs right
after each chunk's reduction is finished, in backward (an optimizer that
steps chunk by chunk: [Note: stepping in backward] in pc_zero.gemini), and
``on_backward_start()`` when a backward pass first reaches the module,
before it touches any chunk, so a refusal raised there leaves nothing half
done. A chunk reduced in this backward is not gathered again by a
prefetch.

[Note: a chunk without gradients]
In single-process training a parameter that got no gradient in a step
keeps ``.grad`` None and the optimizer leaves it alone. Reducing it as a
zero gradient would not be the same: Adam would still move it (weight
decay, and moments decaying into a non-zero update). So the end-of-backward
callback never reduces a chunk none of whose parameters got a gradient,
even a gathered one (a prefetch that a changed control flow sent astray, a
module that ran or returned early without its parameters reaching the
loss, a chunk kept from forward with ``reshard_after_forward=False``): it
releases it, and the chunk is skipped like one never gathered. A chunk
some of whose parameters got one is reduced, and the manager tells it
which (``note_gradients``): the others' exposed ``.grad`` stays None, over
accumulated micro-batches too, so the optimizer skips them. Every rank
must take the same control flow (skip the same layers), since each rank
decides from its own gradients.

[Note: units]
``units=[(module, params), ...]`` packs each unit's parameters into one
chunk of exactly their size (rounded up to a multiple of the world size)
and drives it from that module's hooks: FSDP's flat parameter per wrapped
module. Without units, chunks are equal-sized and packed in execution
order (Gemini).

[Note: oversized parameters]
With an equal ``chunk_size``, a parameter larger than it gets a chunk of its
own, sized to it (rounded up to a multiple of the world size): a chunk size
searched with the largest parameters left out ([Note: grid search] in
pc_chunk.search) packs everything else
tightly. The chunk open before it is closed, so the next parameter opens a
new one. ``chunk_per_tensor=True`` does this for every parameter: one chunk
per tensor (what ``chunk_size=None`` means at the compatibility edge,
docs/packages/pc-compat.md). The packing is planned before any chunk is built, so static
placement knows the chunk count exactly.

[Note: lazy parameters]
A parameter built inside :class:`~pc_chunk.lazy.LazyInitContext` is a
meta tensor until its chunk is packed: then, and only then, it is
materialised (``init_param``, by default :func:`~pc_chunk.lazy.materialize_`
on the manager's device), copied into the chunk and, once the chunk is
closed, only its shard remains. So the peak while packing is the shards so
far, one chunk's payload and one parameter, never the model. Without
example inputs (a lazy model cannot run a forward) the order is module
order.

[Note: placement]
``StaticPlacement(shard_fraction, optim_fraction)`` keeps the shards of the
first ``shard_fraction`` of the chunks (in execution order) on the device,
the rest on the host, and says which chunks' optimizer states go on the
device. ``AutoPlacement`` decides chunk by chunk as the step runs: before a
module runs, it makes room in the budget for the chunks it needs plus the
non-model memory the :class:`~pc_chunk.tracer.MemoryTracer` recorded for
that module, releasing idle payloads and then moving idle shards to the
host, latest in execution order first (a simple stand-in for "needed
furthest ahead"; it does not yet look at where in the step we are).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from pc_chunk.budget import DeviceBudget
from pc_chunk.chunk import Chunk, ChunkState
from pc_chunk.lazy import is_lazy, materialize_
from pc_chunk.search import grid_search_chunk_size, search_chunk_size
from pc_comm import Communicator, weak_method
from pc_offload import CopyEngine

__all__ = ["AutoPlacement", "ChunkManager", "StaticPlacement", "execution_order"]


def execution_order(module: nn.Module, *args: Any, **kwargs: Any) -> list[nn.Parameter]:
    """The module's parameters in order of first use [Note: execution order]."""
    seen: dict[nn.Parameter, None] = {}
    handles: list[RemovableHandle] = []
    if (args or kwargs) and any(is_lazy(p) for p in module.parameters()):
        raise ValueError(
            "execution_order: the module was built lazily (LazyInitContext), so it cannot run "
            "a forward on example inputs yet; drop the example inputs (module order is used) "
            "or materialise the module first (pc_chunk.materialize_module)."
        )

    def record(mod: nn.Module, _args: Any) -> None:
        for param in mod.parameters(recurse=False):
            seen.setdefault(param, None)

    for mod in module.modules():
        handles.append(mod.register_forward_pre_hook(record))
    try:
        if args or kwargs:
            with torch.no_grad():
                module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for param in module.parameters():
        seen.setdefault(param, None)
    return list(seen)


@dataclass(frozen=True)
class StaticPlacement:
    """Fixed fractions of shards and optimizer states on the device."""

    shard_fraction: float = 1.0
    optim_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("shard_fraction", "optim_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}.")

    def shard_on_device(self, index: int, count: int) -> bool:
        return index < round(self.shard_fraction * count)

    def optim_on_device(self, index: int, count: int) -> bool:
        return index < round(self.optim_fraction * count)


@dataclass(frozen=True)
class AutoPlacement:
    """Room made chunk by chunk from the tracer's non-model figures
    [Note: placement]; ``non_model_bytes`` maps a module's qualified name
    to the peak non-model memory recorded while it ran."""

    non_model_bytes: dict[str, int] | None = None
    optim_on_host: bool = True

    def shard_on_device(self, index: int, count: int) -> bool:
        return True  # start on the device; evicted as room is needed

    def optim_on_device(self, index: int, count: int) -> bool:
        return not self.optim_on_host


Placement = StaticPlacement | AutoPlacement


class ChunkManager:
    """Owns the chunks of ``module`` and answers which chunk holds a
    parameter. ``chunk_size=None`` searches for the size with the least
    padding (see :func:`~pc_chunk.search.search_chunk_size`);
    ``chunk_per_tensor=True`` gives each parameter its own chunk [Note:
    oversized parameters]. With an
    ``engine`` (pc-offload's :class:`~pc_offload.CopyEngine`), shards moved
    to the host live in its pinned pool. With ``expose_shards`` each
    parameter is its fp32 master shard between steps, whatever dtype the
    model was built in (bf16/fp16 values are upcast exactly: [Note: exposed
    shards] in pc_chunk.chunk); ``compute_dtype`` is the dtype chunks are
    gathered and computed in (default: the shard dtype)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        example_inputs: tuple[Any, ...] = (),
        chunk_size: int | None = None,
        comm: Communicator | None = None,
        device: torch.device | str = "cpu",
        budget: DeviceBudget | None = None,
        placement: Placement | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        engine: CopyEngine | None = None,
        search_range: int = 64 * 1024 * 1024,
        min_chunk_size: int = 1024,
        units: Sequence[tuple[nn.Module, Sequence[nn.Parameter]]] | None = None,
        compute_dtype: torch.dtype | None = None,
        expose_shards: bool = False,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        init_param: Callable[[nn.Parameter], None] | None = None,
        chunk_per_tensor: bool = False,
        replica_comm: Communicator | None = None,
    ) -> None:
        self.module = module
        # [Note: lazy parameters]
        self._init_param = init_param if init_param is not None else self._materialize
        self.comm = comm
        self.device = torch.device(device)
        self.budget = budget
        self.placement: Placement = placement if placement is not None else StaticPlacement()
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        world = comm.world_size if comm is not None else 1
        self._chunk_args: dict[str, Any] = {
            # One rank's gather and reduce-scatter are copies: no collective
            # (a host communicator would stage CUDA chunks through the host).
            "comm": comm if world > 1 else None,
            "device": self.device,
            "budget": budget,
            "reduce_dtype": reduce_dtype,
            "engine": engine,
            "expose_shard": expose_shards,
            # Two-level sharding ([Note: shards] in pc_chunk.chunk).
            "replica_comm": replica_comm
            if replica_comm is not None and replica_comm.world_size > 1
            else None,
        }
        # The shards: fp32 masters when exposed ([Note: exposed shards] in
        # pc_chunk.chunk), whatever dtype the model was built in; otherwise
        # each parameter's own dtype.
        self.expose_shards = expose_shards
        # The payload (compute) dtype; None computes in the shard dtype.
        self.compute_dtype = compute_dtype
        self.chunks: list[Chunk] = []
        self._index: dict[Chunk, int] = {}  # position in execution order
        self._where: dict[nn.Parameter, Chunk] = {}
        self._hooked: dict[nn.Module, list[Chunk]] = {}  # module -> chunks its hooks drive
        self._init_driving()
        if units is not None:
            self._pack_units(units, world)
        else:
            self._pack_in_order(
                example_inputs, chunk_size, chunk_per_tensor, search_range, min_chunk_size, world
            )
        # Chunks holding a parameter that several modules use (a tied
        # weight): reduced at the end of backward [Note: tied weights reduce
        # last], however early their gradients seem complete.
        self._shared: set[Chunk] = self._chunks_with_shared_parameters()

    def _pack_units(
        self, units: Sequence[tuple[nn.Module, Sequence[nn.Parameter]]], world: int
    ) -> None:
        """One chunk per unit, driven by the unit's hooks [Note: units]."""
        self.order = [p for _, params in units for p in params if p.requires_grad]
        self.chunk_size = 0
        self._expected_chunks = sum(1 for _, ps in units if any(p.requires_grad for p in ps))
        for unit, params in units:
            mine = [p for p in params if p.requires_grad]
            if not mine:
                continue
            dtypes = {self._shard_dtype(p) for p in mine}
            if len(dtypes) > 1:
                raise ValueError(
                    f"a unit's parameters must share one dtype; {type(unit).__name__} has "
                    f"{sorted(str(d) for d in dtypes)}. Cast the module first."
                )
            numel = sum(p.numel() for p in mine)
            chunk = self._pack_chunk(-(-numel // world) * world, dtypes.pop(), mine)
            self._hooked[unit] = [chunk]

    def _pack_in_order(
        self,
        example_inputs: tuple[Any, ...],
        chunk_size: int | None,
        chunk_per_tensor: bool,
        search_range: int,
        min_chunk_size: int,
        world: int,
    ) -> None:
        """Equal chunks (or one per tensor) packed in execution order, each
        driven by the hooks of every module holding one of its parameters
        [Note: execution order], [Note: oversized parameters]."""
        self.order = [p for p in execution_order(self.module, *example_inputs) if p.requires_grad]
        if chunk_per_tensor and chunk_size is not None:
            raise ValueError(
                f"chunk_per_tensor=True gives every parameter a chunk of its own size; "
                f"chunk_size={chunk_size} asks for one size. Pass one of them."
            )
        if chunk_size is None and not chunk_per_tensor:
            granularity = 64 * world
            chunk_size = search_chunk_size(
                self.order, search_range, min_chunk_size, granularity
            ).chunk_size
        if chunk_size is not None and chunk_size % world:
            raise ValueError(
                f"chunk_size {chunk_size} is not a multiple of the world size {world}."
            )
        # 0: no single size (one chunk per tensor).
        self.chunk_size = chunk_size if chunk_size is not None else 0
        plan = self._plan(chunk_size, world)
        # Static placement asks where chunk i of how many goes: the plan knows.
        self._expected_chunks = len(plan)
        for size, dtype, params in plan:
            self._pack_chunk(size, dtype, params)
        for mod in self.module.modules():
            found: dict[Chunk, None] = {}
            for param in mod.parameters(recurse=False):
                if param in self._where:
                    found.setdefault(self._where[param], None)
            if found:
                self._hooked[mod] = list(found)

    def _pack_chunk(self, size: int, dtype: torch.dtype, params: list[nn.Parameter]) -> Chunk:
        """A new chunk holding ``params`` (materialised as they are packed:
        [Note: lazy parameters]), closed to its shard."""
        chunk = self._new_chunk(size, dtype)
        for param in params:
            self._init_param(param)
            chunk.append(param)
            self._where[param] = chunk
        self._finish(chunk)
        return chunk

    @staticmethod
    def search_chunk_size(
        module: nn.Module,
        search_range: int,
        n_grids: int,
        min_chunk_size: int | None = None,
        filter_exlarge_params: bool = True,
    ) -> int:
        """The chunk size (elements) with the least padding for ``module``'s
        parameters in module order [Note: grid search] in pc_chunk.search."""
        params = [p for p in module.parameters() if p.requires_grad]
        return grid_search_chunk_size(
            params, search_range, n_grids, min_chunk_size, filter_exlarge_params
        )

    def _shard_dtype(self, param: nn.Parameter) -> torch.dtype:
        return torch.float32 if self.expose_shards else param.dtype

    def _plan(
        self, chunk_size: int | None, world: int
    ) -> list[tuple[int, torch.dtype, list[nn.Parameter]]]:
        """(size, shard dtype, parameters) of each chunk, in the order the
        chunks open [Note: packing] in pc_chunk.search; ``chunk_size=None``:
        one chunk per parameter [Note: oversized parameters]."""
        plan: list[tuple[int, torch.dtype, list[nn.Parameter]]] = []
        open_chunks: dict[torch.dtype, int] = {}  # dtype -> index of its open chunk
        fill: dict[torch.dtype, int] = {}
        for param in self.order:
            dtype = self._shard_dtype(param)
            numel = param.numel()
            own = -(-numel // world) * world  # a chunk of its own size
            if chunk_size is None or numel > chunk_size:
                plan.append((own, dtype, [param]))
                open_chunks.pop(dtype, None)  # the next parameter opens a new one
                continue
            index = open_chunks.get(dtype)
            if index is None or fill[dtype] + numel > chunk_size:
                index = len(plan)
                plan.append((chunk_size, dtype, []))
                open_chunks[dtype], fill[dtype] = index, 0
            plan[index][2].append(param)
            fill[dtype] += numel
        return plan

    def _materialize(self, param: nn.Parameter) -> None:
        if is_lazy(param):
            materialize_(param, self.device)

    def _init_driving(self) -> None:
        self._hooks: list[Any] = []
        self._arrived: dict[Chunk, set[nn.Parameter]] = {}
        self._callback_queued = False
        self._in_backward: set[nn.Module] = set()
        self._module_names = {m: n for n, m in self.module.named_modules()}
        self._workspace = 0  # non-model bytes reserved for the running module (auto)
        # [Note: releasing and prefetching]
        self._pending_release: dict[Chunk, None] = {}
        self._reducing: list[Chunk] = []  # reduce-scatters in flight, oldest first
        self.on_reduced: Callable[[Chunk], None] | None = None  # [Note: overlapped reduction]
        self.on_backward_start: Callable[[], None] | None = None
        self._reduced: set[Chunk] = set()  # reduced in the running backward
        self._events: tuple[list[Chunk], list[Chunk]] = ([], [])  # gathers: forward, backward
        self._cursor = [0, 0]
        self._orders_recorded = False
        # Chunks a forward needed again after releasing them (a weight tied
        # at both ends of the model): from then on kept until backward.
        self._sticky: set[Chunk] = set()
        self._used_this_forward: set[Chunk] = set()

    def _new_chunk(self, size: int, dtype: torch.dtype) -> Chunk:
        compute = self.compute_dtype if self.compute_dtype is not None else dtype
        chunk = Chunk(
            size, compute, name=f"chunk{len(self.chunks)}", shard_dtype=dtype, **self._chunk_args
        )
        self._index[chunk] = len(self.chunks)
        self.chunks.append(chunk)
        return chunk

    def _finish(self, chunk: Chunk) -> None:
        # [Note: shards]: only the shard persists between uses.
        on_device = self.placement.shard_on_device(self._index[chunk], self._expected_chunks)
        if isinstance(self.placement, AutoPlacement) and self.budget is not None:
            # Shards go on the device while room stays for a step's working
            # set: one payload, a gradient buffer and a gradient shard.
            headroom = chunk.payload_bytes + chunk.reduce_bytes
            available = self.budget.available_bytes + chunk.payload_bytes - chunk.shard_bytes
            on_device = available >= headroom
        chunk.close(shard_on_device=on_device, release=True, trim=True)

    def chunk_of(self, param: nn.Parameter) -> Chunk:
        try:
            return self._where[param]
        except KeyError:
            raise KeyError(
                "this parameter is not managed by the ChunkManager (not in the module, or "
                "requires_grad=False)."
            ) from None

    def optim_on_device(self, chunk: Chunk) -> bool:
        return self.placement.optim_on_device(self._index[chunk], len(self.chunks))

    # -- making room (auto placement) ----------------------------------------

    def _make_room(self, needed: list[Chunk], module: nn.Module | None, extra: int = 0) -> None:
        if self.budget is None or not isinstance(self.placement, AutoPlacement):
            return
        figures = self.placement.non_model_bytes or {}
        workspace = figures.get(self._module_names.get(module, ""), 0) if module else 0
        want = workspace + extra
        want += sum(c.payload_bytes for c in needed if c.state is ChunkState.FREE)
        idle = [c for c in self.chunks if c not in needed and c.users == 0]
        idle.sort(key=lambda c: -self._index[c])  # latest in execution order first
        for chunk in idle:  # first drop idle payloads, then move idle shards out
            if self.budget.available_bytes >= want:
                break
            if chunk.state in (ChunkState.HOLD, ChunkState.HOLD_AFTER_FWD):
                chunk.release()
        for chunk in idle:
            if self.budget.available_bytes >= want:
                break
            chunk.move_shard(False)
        self._release_workspace()
        if workspace and module is not None:
            self.budget.reserve(workspace, f"non-model memory of {self._module_names[module]}")
            self._workspace = workspace

    def _release_workspace(self) -> None:
        if self.budget is not None and self._workspace:
            self.budget.free(self._workspace, "non-model memory")
            self._workspace = 0

    # -- driving a step [Note: driving a step] ----------------------------------

    def _chunks_of(self, module: nn.Module) -> list[Chunk]:
        return self._hooked.get(module, [])

    def attach(self) -> None:
        """Install the forward/backward hooks that drive the chunks."""
        if self._hooks:
            return
        for module in self._hooked:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(module.register_forward_hook(self._post_forward))
        if self.module not in self._hooked:
            self._hooks.append(self.module.register_forward_hook(self._post_forward))
        for param in self._where:
            hook = param.register_post_accumulate_grad_hook(weak_method(self._on_grad))  # type: ignore[no-untyped-call]
            self._hooks.append(hook)

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @staticmethod
    def _in_autograd() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        chunks = self._chunks_of(module)
        for chunk in list(self._pending_release):  # [Note: releasing and prefetching]
            if chunk not in chunks and chunk.users == 0:
                chunk.release()
            del self._pending_release[chunk]
        self._make_room(chunks, module)
        in_autograd = self._in_autograd()
        gathered = [c for c in chunks if c.state is ChunkState.FREE]
        for chunk in chunks:
            if not in_autograd:
                revisited = chunk in self._used_this_forward and chunk.state is ChunkState.FREE
                if revisited and chunk in self._shared:  # a tied weight, used again: keep it
                    self._sticky.add(chunk)
                self._used_this_forward.add(chunk)
            chunk.access()
        # Recomputation inside backward follows backward's order.
        self._advance(chunks, gathered, 1 if in_autograd else 0)

    def _advance(self, chunks: list[Chunk], gathered: list[Chunk], phase: int) -> None:
        """[Note: releasing and prefetching]: the first step records the
        order chunks get gathered in (phase 0 forward, 1 backward); later
        steps follow it with a cursor and start the next gather early."""
        events = self._events[phase]
        if not self._orders_recorded:
            events.extend(gathered)
            return
        cursor = self._cursor[phase]
        for chunk in chunks:
            if cursor < len(events) and events[cursor] is chunk:
                cursor += 1
        self._cursor[phase] = cursor
        if not self.prefetch or cursor >= len(events):
            return
        ahead = events[cursor]
        if ahead in self._reduced:  # astray: its gradients are already reduced
            return
        if ahead.state is ChunkState.FREE and (
            self.budget is None or self.budget.available_bytes >= 2 * ahead.payload_bytes
        ):
            ahead.gather(async_op=True)

    def _post_forward(self, module: nn.Module, _args: Any, out: Any) -> None:
        # The module's backward begins when the gradient of one of its
        # outputs is ready: a hook on those tensors (a full backward pre-hook
        # would warn, and misfire, when no input requires grad).
        in_autograd = self._in_autograd()
        if torch.is_grad_enabled() and not in_autograd:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda _g, m=module: self._pre_backward(m))  # type: ignore[no-untyped-call]
        self._release_workspace()
        keep = in_autograd or (torch.is_grad_enabled() and not self.reshard_after_forward)
        for chunk in self._chunks_of(module):
            chunk.done("forward")
            if chunk.users == 0 and not keep and chunk not in self._sticky:
                self._pending_release[chunk] = None
        if module is self.module and not in_autograd:  # the forward pass ends
            for chunk in self._pending_release:
                if chunk.users == 0:
                    chunk.release()
            self._pending_release.clear()
            self._used_this_forward.clear()
            self._cursor[0] = 0
            if not torch.is_grad_enabled():
                if not self._orders_recorded:
                    self._events[0].clear()  # record a training forward
                for chunk in self._sticky:
                    if chunk.users == 0:
                        chunk.release()

    def _pre_backward(self, module: nn.Module) -> None:
        if module in self._in_backward:
            return
        if not self._callback_queued and self.on_backward_start is not None:
            self.on_backward_start()  # before any state changes: it may refuse
        self._in_backward.add(module)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        chunks = self._chunks_of(module)
        self._make_room(chunks, module)
        gathered = [c for c in chunks if c.state is ChunkState.FREE]
        for chunk in chunks:
            chunk.access()
        self._advance(chunks, gathered, 1)

    def _chunks_with_shared_parameters(self) -> set[Chunk]:
        users: dict[int, int] = {}
        for module in self.module.modules():
            for param in module.parameters(recurse=False):
                users[id(param)] = users.get(id(param), 0) + 1
        return {chunk for param, chunk in self._where.items() if users.get(id(param), 0) > 1}

    # [Note: tied weights reduce last]
    # A weight two modules use (an LM head tied to the embedding) gets a
    # gradient from each. Under mixed precision each use reads its own
    # compute-dtype copy, and the gradient hook can fire once per use: a
    # chunk reduced at the first would be reduced (and, stepping in
    # backward, stepped) again at the second. Such chunks wait for the end
    # of backward, when every use has contributed.

    def _on_grad(self, param: torch.Tensor) -> None:
        chunk = self._where[param]  # type: ignore[index]
        arrived = self._arrived.setdefault(chunk, set())
        arrived.add(param)  # type: ignore[arg-type]
        if len(arrived) == len(chunk.slots) and chunk not in self._shared:
            self._reduce(chunk)

    def _reduce(self, chunk: Chunk) -> None:
        # [Note: overlapped reduction]
        if self.budget is not None:
            self._finish_reductions(0)
        self._make_room([chunk], None, chunk.reduce_bytes)
        chunk.gather()  # a no-op unless the chunk was evicted meanwhile
        chunk.done("backward")
        chunk.note_gradients(self._arrived.get(chunk, set()))
        chunk.reduce_scatter_grads(async_op=True)
        chunk.release()
        self._arrived.pop(chunk, None)
        self._reduced.add(chunk)
        self._reducing.append(chunk)
        self._finish_reductions(1)

    def _finish_reductions(self, keep: int) -> None:
        while len(self._reducing) > keep:
            chunk = self._reducing.pop(0)
            chunk.finish_reduce()
            if self.on_reduced is not None:
                self.on_reduced(chunk)

    def _end_backward(self) -> None:
        self._release_workspace()
        for chunk in self.chunks:
            if chunk in self._arrived:
                self._reduce(chunk)
            elif chunk.state is not ChunkState.FREE:
                # No gradient this step [Note: a chunk without gradients]:
                # whatever used it is over (backward has ended).
                chunk.abandon()
                chunk.release()
        self._finish_reductions(0)
        self._reduced.clear()
        self._arrived = {}
        self._callback_queued = False
        self._in_backward.clear()
        self._pending_release.clear()
        self._orders_recorded = True
        self._cursor = [0, 0]

    # -- optimizer side -------------------------------------------------------

    def step(self, update: Callable[[Chunk, torch.Tensor], torch.Tensor]) -> None:
        """For every chunk with a gradient shard: ``update(chunk, grad_shard)``
        returns the new fp32 master values of this rank's shard, which are
        written back into the chunk; the gradient shard is then dropped."""
        for chunk in self.chunks:
            if chunk.grad_shard is not None:
                chunk.set_shard(update(chunk, chunk.grad_shard))
                chunk.clear_grad()
