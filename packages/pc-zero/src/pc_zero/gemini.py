"""ZeRO-3 by chunks (Gemini, docs/packages/pc-zero.md): :class:`GeminiDDP` and
:class:`GeminiOptimizer`.

[Note: Gemini]
Parameters are packed in execution order into equal chunks (the size
searched for the least padding, or given), each sharded over the ranks
(pc_chunk.manager). One all-gather serves every parameter of a chunk: the
modules of a transformer block that share a chunk gather it once in
forward and once in backward, and activation-checkpoint recomputation,
which runs inside backward, finds it already gathered (nothing is released
during backward until the chunk's gradients are reduced).

Heterogeneous placement: the shards (fp32 masters, their gradient shards,
so also their optimizer states, which the optimizer creates next to each
parameter) of the first chunks in execution order stay on the device and
the rest on the host. ``placement_policy="static"`` takes the host
fraction from ``offload_param_frac``; ``"auto"`` derives it from
``device_budget_bytes``: the chunks whose shard, gradient shard and Adam
states fit after reserving the working set (two gathered chunks, one
gradient buffer, and the non-model memory the MemoryTracer measured when
``example_inputs`` are given). Every device byte of chunk data is reserved
in a :class:`~pc_chunk.DeviceBudget`, which raises rather than exceed it.
:class:`~pc_offload.HybridAdam` steps device shards on the device and host
shards on the host.

[Note: stepping in backward]
With ``GeminiDDP(..., step_in_backward=True)`` (or
``FullyShardedDataParallel(..., step_in_backward=True)``) the :class:`GeminiOptimizer`
steps each chunk's parameters the moment that chunk's gradients are
reduced, inside backward, and drops the gradient shard at once; the
``step()`` call after backward has nothing left to do. Only the one or two
chunks whose reductions are being finished hold a gradient shard, so
between steps a rank keeps 12 bytes per parameter of its shards (fp32
master and two Adam moments) instead of 16: on a GPU, the host gradient
buffers of offloaded chunks are gone and "auto" placement fits more chunks
on the device. Each chunk is stepped by the wrapped optimizer with only its
own parameters in the param groups, so the update is the same element-wise
step as stepping everything after backward (same hyperparameters, same
per-parameter state), and parity with single-process training holds.
What needs every gradient before any update is refused: global-norm
clipping (``max_norm``), fp16 loss scaling (an overflow found late cannot
undo the chunks already stepped; bf16 needs no scaler) and gradient
accumulation (a second backward before ``step()`` raises before it
touches a parameter).

[Note: placement policies]
``"cuda"`` keeps every shard on the compute device
(nothing offloaded), ``"cpu"`` every shard on the host, ``"auto"`` as many
as fit the budget (``device_budget_bytes``, by default the GPU's free memory
when the compute device is CUDA; a CPU device has no free memory to plan
against, so it must be given), and pc's ``"static"`` the last
``offload_param_frac`` of the chunks on the host. Whether a chunk's shard
is on the device is its ``shard_on_device``, which the budget accounts. On
a CUDA device, shards on the host move through pc-offload's copy engine in
pinned host buffers with ``pin_memory=True`` (pc's default) and in pageable
ones with ``pin_memory=False``. With a CPU compute device the host *is* the
device: nothing is copied, so there is nothing to pin and ``pin_memory``
changes nothing there.

[Note: step clears the gradients]
``GeminiOptimizer.step()`` ends with the gradients cleared (the exposed
``.grad`` and each chunk's gradient shard), on a skipped step too
(docs/packages/pc-zero.md): an accumulation loop (several
backwards, one ``step()``, ``zero_grad()`` or not) starts every window from
zero. The host gradient buffers of offloaded chunks are kept for the next
step [Note: host buffers] in pc_chunk.chunk.

[Note: loss scaling in every precision]
Loss scaling exists for fp16; under fp32 or bf16 compute GeminiOptimizer
does not scale unless ``scale_every_precision=True``, which the edge's
``ZeroOptimizer`` (docs/packages/pc-compat.md) asks for: its
``initial_scale`` and friends then apply as asked (the loss is multiplied,
the gradient shards divided, a step whose gradients overflow is skipped
and the scale backs off). A power-of-two scale changes fp32 results by
nothing but over- or underflow.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from pc_chunk import (
    BudgetExceededError,
    Chunk,
    ChunkManager,
    ChunkState,
    DeviceBudget,
    MemoryTracer,
    StaticPlacement,
    is_lazy,
)
from pc_chunk.manager import execution_order
from pc_comm import Communicator, default_communicator
from pc_offload import (
    CopyEngine,
    PinnedPool,
    check_own_masters,
    moment_bytes,
    parse_state_dtype,
)
from pc_zero.clipping import ClipsInStep
from pc_zero.gemini_search import ChunkOptions, searched_chunk_size
from pc_zero.loss_scale import (
    DynamicLossScaler,
    LossScaleConfig,
    NonFiniteGradientError,
    counts_under_tensor_parallel,
    unscale_clip_and_check,
)
from pc_zero.sharded import MixedPrecision, ShardedModule, prepare_module

__all__ = ["GeminiDDP", "GeminiOptimizer", "PlacementPolicy", "searched_chunk_size"]

# Optimizer state bytes per element that "auto" placement plans for (Adam:
# momentum and variance in fp32).
_STATE_BYTES = 8


class PlacementPolicy(Enum):
    """Where chunk shards rest between uses [Note: Gemini]; the strings are
    parsed once, where the user's options come in."""

    STATIC = "static"  # the last offload_param_frac of the chunks on the host
    AUTO = "auto"  # as many chunks on the device as the budget holds
    CUDA = "cuda"  # every shard on the compute device (nothing offloaded)
    CPU = "cpu"  # every shard on the host

    @classmethod
    def parse(cls, value: str | PlacementPolicy) -> PlacementPolicy:
        if isinstance(value, PlacementPolicy):
            return value
        names = [p.value for p in cls]
        if value not in names:
            raise ValueError(f"placement_policy must be one of {names}, got {value!r}.")
        return cls(value)


class GeminiDDP(ShardedModule):
    """ZeRO-3 over chunks [Note: Gemini]. ``mixed_precision`` is the compute
    dtype (fp32 masters stay in the shards, whatever dtype the model was
    built in: [Note: build dtype] in pc_zero.sharded); fp16 needs
    :class:`GeminiOptimizer` for loss scaling. Build the optimizer after
    wrapping, over ``model.parameters()``. The chunk search takes
    ``search_range_mb`` / ``min_chunk_size_mb`` /
    ``hidden_dim`` as well as pc's element counts [Note: chunk search]
    in pc_zero.gemini_search;
    ``pin_memory`` and the placement policies: [Note: placement policies].
    ``replica_process_group``: two-level sharding, the chunks sharded over
    ``process_group`` and replicated over this group, each reduced shard
    averaged across it ([Note: shards] in pc_chunk.chunk;
    ``pc_comm.two_level_groups`` makes both groups)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device | str | None = None,
        placement_policy: str | PlacementPolicy = "static",
        pin_memory: bool = True,
        offload_param_frac: float = 0.0,
        device_budget_bytes: int | None = None,
        mixed_precision: torch.dtype = torch.float32,
        chunk_size: int | None = None,
        chunk_per_tensor: bool = False,
        search_range: int | None = None,
        min_chunk_size: int | None = None,
        search_range_mb: float | None = None,
        min_chunk_size_mb: float | None = None,
        hidden_dim: int | None = None,
        force_outputs_fp32: bool = False,
        example_inputs: tuple[Any, ...] = (),
        process_group: dist.ProcessGroup | None = None,
        comm: Communicator | None = None,
        sync_module_states: bool = False,
        prefetch: bool = True,
        step_in_backward: bool = False,
        replica_process_group: dist.ProcessGroup | None = None,
    ) -> None:
        policy = PlacementPolicy.parse(placement_policy)
        replicas = _replicas(module, replica_process_group, sync_module_states)
        _check_placement_and_sizes(policy, offload_param_frac, device_budget_bytes, chunk_size)
        chunks = ChunkOptions.checked(
            chunk_size, chunk_per_tensor, search_range, min_chunk_size, search_range_mb,
            min_chunk_size_mb, hidden_dim,
        )  # fmt: skip
        comm, device, init_param = prepare_module(
            module, "GeminiDDP", comm, process_group, device, sync_module_states, mixed_precision
        )
        if policy is PlacementPolicy.AUTO and device_budget_bytes is None:
            device_budget_bytes = _free_device_bytes(device)
        world = comm.world_size
        order = [p for p in execution_order(module, *example_inputs) if p.requires_grad]
        chunk_size = chunks.size_for([p.numel() for p in order], world)
        # The largest chunk: a parameter above chunk_size gets one of its own
        # ([Note: oversized parameters] in pc_chunk.manager).
        largest = -(-max(p.numel() for p in order) // world) * world
        widest = max(chunk_size or 0, largest)
        self.placement_policy = policy
        self.pin_memory = pin_memory
        self.force_outputs_fp32 = force_outputs_fp32
        self.budget = DeviceBudget(device_budget_bytes) if device_budget_bytes is not None else None
        if policy is PlacementPolicy.CPU:
            offload_param_frac = 1.0
        elif policy is PlacementPolicy.AUTO:
            assert device_budget_bytes is not None
            non_model = _non_model_peak(module, example_inputs) if example_inputs else 0
            total = sum(p.numel() for p in order)
            count = len(order) if chunk_size is None else max(1, math.ceil(total / chunk_size))
            offload_param_frac = _auto_offload_fraction(
                count, widest, world, device_budget_bytes, non_model, mixed_precision,
                step_in_backward,
            )  # fmt: skip
        self.offload_param_frac = offload_param_frac
        manager = self._chunk_manager(
            module, example_inputs, chunk_size, chunk_per_tensor, comm, device, mixed_precision,
            prefetch, init_param, device_budget_bytes, replicas,
        )  # fmt: skip
        self._check_budget_gathers(widest, mixed_precision, device_budget_bytes)
        mp = MixedPrecision(mixed_precision) if mixed_precision != torch.float32 else None
        super().__init__(module, manager, comm, mp, step_in_backward=step_in_backward)

    def _chunk_manager(
        self,
        module: nn.Module,
        example_inputs: tuple[Any, ...],
        chunk_size: int | None,
        chunk_per_tensor: bool,
        comm: Communicator,
        device: torch.device,
        compute_dtype: torch.dtype,
        prefetch: bool,
        init_param: Callable[[nn.Parameter], None],
        device_budget_bytes: int | None,
        replicas: Communicator | None,
    ) -> ChunkManager:
        """The module's chunks, their shards placed as this wrapper's
        placement says [Note: placement policies]."""
        try:
            return ChunkManager(
                module,
                example_inputs=example_inputs,
                chunk_size=chunk_size,
                chunk_per_tensor=chunk_per_tensor,
                comm=comm,
                device=device,
                budget=self.budget,
                placement=StaticPlacement(1.0 - self.offload_param_frac),
                engine=_copy_engine(device, self.pin_memory),
                compute_dtype=compute_dtype,
                expose_shards=True,
                prefetch=prefetch,
                init_param=init_param,
                replica_comm=replicas,
            )
        except BudgetExceededError as error:  # the placement asked for cannot fit: a setting
            raise ValueError(
                f"GeminiDDP: device_budget_bytes={device_budget_bytes} cannot hold the chunks "
                f"placement_policy={self.placement_policy.value!r} keeps on the device ({error})"
            ) from None

    def _check_budget_gathers(
        self, widest: int, compute_dtype: torch.dtype, device_budget_bytes: int | None
    ) -> None:
        """Forward gathers a whole chunk in the compute dtype: a budget
        without room for one after the resident shards can never run."""
        if self.budget is None:
            return
        gathered = widest * torch.empty((), dtype=compute_dtype).element_size()
        if self.budget.available_bytes < gathered:
            raise ValueError(
                f"GeminiDDP: device_budget_bytes={device_budget_bytes} leaves "
                f"{self.budget.available_bytes} bytes after the resident shards, but "
                f"gathering one chunk ({widest} elements) needs {gathered}. Raise the "
                "budget, keep more on the host (offload_param_frac, or placement 'auto'), "
                "or use a smaller chunk_size."
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if not self.force_outputs_fp32:
            return out

        def upcast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.float()
            return x

        return tree_map(upcast, out)


def _replicas(
    module: nn.Module, group: dist.ProcessGroup | None, sync_module_states: bool
) -> Communicator | None:
    """Two-level sharding [Note: shards] in pc_chunk.chunk: the communicator
    over the ranks holding the same shards (None for one), after copying
    the first replica's eager parameters and buffers to the others under
    ``sync_module_states`` (the shard group then copies its first rank's:
    every rank ends with rank 0's). Lazy parameters are materialised with
    eager construction's values, the same on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    if sync_module_states:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not is_lazy(tensor) and not tensor.is_meta:
                    dist.broadcast(tensor.data, src, group=group)
    return default_communicator(group)


def _check_placement_and_sizes(
    policy: PlacementPolicy,
    offload_param_frac: float,
    device_budget_bytes: int | None,
    chunk_size: int | None,
) -> None:
    if not 0.0 <= offload_param_frac <= 1.0:
        raise ValueError(f"offload_param_frac must be in [0, 1], got {offload_param_frac}.")
    if offload_param_frac and policy is not PlacementPolicy.STATIC:
        raise ValueError(
            f"offload_param_frac={offload_param_frac} is the host fraction of "
            f"placement_policy='static'; placement_policy={policy.value!r} decides the "
            "host fraction itself. Pass placement_policy='static' to choose it."
        )
    for name, value in (("device_budget_bytes", device_budget_bytes),
                        ("chunk_size", chunk_size)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{name} must be a positive int or None, got {value!r}.")


def _free_device_bytes(device: torch.device) -> int:
    """What "auto" plans against without a budget: the device's free memory
    (on a CPU-only machine the host is the device: its available memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    raise ValueError(
        "placement_policy='auto' plans against a device budget: it defaults to the free "
        f"memory of a CUDA device or the host, but the compute device is {device}; pass "
        "device_budget_bytes (the bytes chunk data may use on the device)."
    )


def _copy_engine(device: torch.device, pin_memory: bool) -> CopyEngine | None:
    """Host <-> device copies of offloaded shards [Note: placement policies]:
    pinned host buffers with ``pin_memory``, pageable ones without."""
    if device.type != "cuda":
        return None  # the host is the device: nothing is copied, nothing to pin
    return CopyEngine(PinnedPool(pin=pin_memory))


def _non_model_peak(module: nn.Module, example_inputs: tuple[Any, ...]) -> int:
    """Peak non-model bytes of one forward and backward on the inputs,
    measured by pc-chunk's tracer before the module is sharded."""
    tracer = MemoryTracer(module)

    def step() -> None:
        out = module(*example_inputs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.float().sum().backward()

    tracer.trace(step)
    module.zero_grad(set_to_none=True)
    return max(tracer.non_model_bytes().values(), default=0)


def _auto_offload_fraction(
    chunks: int,
    chunk_size: int,
    world: int,
    budget: int,
    non_model: int,
    compute_dtype: torch.dtype,
    step_in_backward: bool = False,
) -> float:
    """The host fraction of ``chunks`` chunks (of up to ``chunk_size``
    elements) for "auto" [Note: Gemini]: the working set first, then as many
    chunks' shard + gradient shard + states as fit. Stepping in backward
    keeps no gradient shard per chunk, but up to two in the working set
    [Note: stepping in backward]."""
    working = 2 * chunk_size * compute_dtype.itemsize + chunk_size * 4 + non_model
    grad_shard = chunk_size // world * 4
    if step_in_backward:
        working += 2 * grad_shard
    per_chunk = chunk_size // world * (4 + _STATE_BYTES) + (0 if step_in_backward else grad_shard)
    fit = max(0, (budget - working) // per_chunk)
    return 1.0 - min(chunks, fit) / chunks


class GeminiOptimizer(ClipsInStep, Optimizer):
    """Wraps a torch optimizer built over a :class:`GeminiDDP`'s parameters:
    loss scaling for fp16 (:class:`~pc_zero.LossScaleConfig`; in every
    precision with ``scale_every_precision`` [Note: loss scaling in every
    precision]), an overflow check across ranks that skips the step, and
    global-norm clipping (``max_norm``, settable; :meth:`clip_next_step`
    clips one step: [Note: clipping inside the step] in pc_zero.clipping),
    shared with ZeRO-1/2. Call
    ``optimizer.backward(loss)``. ``step()`` leaves the gradients cleared
    [Note: step clears the gradients].
    Under ``GeminiDDP(step_in_backward=True)`` it steps chunk by chunk inside
    backward [Note: stepping in backward]."""

    def __init__(
        self,
        optimizer: Optimizer,
        module: ShardedModule,
        *,
        max_norm: float = 0.0,
        loss_scale: LossScaleConfig | None = None,
        scale_every_precision: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(module, ShardedModule):
            raise TypeError(
                f"GeminiOptimizer needs the wrapped model (GeminiDDP), got {type(module).__name__}."
            )
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 disables), got {max_norm}.")
        managed = {id(p) for c in module.chunks for p, _, _ in c.shard_parts()}
        stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in managed]
        if stray:
            raise ValueError(
                f"GeminiOptimizer: {len(stray)} optimizer parameter(s) are not the wrapped "
                "model's; build the optimizer after GeminiDDP, over model.parameters()."
            )
        self.inner = optimizer
        self.module = module
        self.max_norm = float(max_norm)
        # Chunks of tensor-parallel pieces: the norm and the overflow check
        # span the tensor-parallel ranks too [Note: global norm across groups].
        self.tp_group = (
            tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        )
        mp = module.mixed_precision
        fp16 = mp is not None and mp.param_dtype == torch.float16
        if mp is not None and mp.param_dtype == torch.bfloat16:  # fp32 chunks are the masters
            check_own_masters(optimizer, "GeminiOptimizer")
        # [Note: loss scaling in every precision]
        scaled = fp16 or scale_every_precision
        self.scaler = DynamicLossScaler(loss_scale) if scaled else None
        self.last_step_skipped = False  # the last step() found an overflow and skipped
        self._reserve_states(module)
        super().__init__([{"params": [torch.zeros(1)]}], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._stepped: set[Chunk] = set()  # chunks stepped since the last step()
        if self.step_in_backward:
            self._check_step_in_backward(scaled)
            module.manager.on_backward_start = self._check_stepped
            module.manager.on_reduced = self._step_chunk

    # -- [Note: stepping in backward] --------------------------------------------------

    @property
    def step_in_backward(self) -> bool:
        return self.module.step_in_backward

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step only [Note: clipping inside the step] in
        pc_zero.clipping; refused when stepping in backward, whose chunks
        are stepped by the time backward returns."""
        if self.step_in_backward:
            raise ValueError(
                "GeminiOptimizer.clip_next_step: with step_in_backward=True each chunk is "
                "stepped by the time backward returns, so there is nothing left to clip; "
                "clip with step_in_backward=False."
            )
        super().clip_next_step(max_norm)

    def _check_step_in_backward(self, fp16: bool) -> None:
        refused = []
        if self.max_norm > 0:
            refused.append(f"global-norm clipping (max_norm={self.max_norm})")
        if fp16:
            refused.append("fp16 loss scaling (mixed_precision=torch.float16, or a loss scale)")
        if refused:
            raise ValueError(
                "step_in_backward=True updates each chunk before the other "
                f"chunks' gradients exist, which rules out {' and '.join(refused)}: use "
                "step_in_backward=False for it, or bf16 instead of fp16."
            )

    def _groups_of(self, chunk: Chunk) -> list[list[torch.Tensor]]:
        """Each param group's parameters that live in ``chunk``, in the group's order."""
        mine = {id(slot.param) for slot in chunk.slots}
        return [[p for p in g["params"] if id(p) in mine] for g in self.inner.param_groups]

    def _check_stepped(self) -> None:
        """At the start of a backward, before it touches a chunk: refuse a
        second one since the last ``step()``."""
        if self._stepped:
            raise RuntimeError(
                "step_in_backward=True: a second backward before optimizer.step(). "
                "Every backward is a step in this mode, so gradients cannot accumulate over "
                "several; call step() after each backward (this backward changed nothing), "
                "or use step_in_backward=False for gradient accumulation."
            )

    def _step_chunk(self, chunk: Chunk) -> None:
        if chunk in self._stepped:  # a backstop: _check_stepped refuses this earlier
            raise RuntimeError(f"{chunk.name}: stepped twice without optimizer.step().")
        if chunk.state is not ChunkState.FREE:  # the parameters would view the payload
            raise RuntimeError(f"{chunk.name}: stepped in state {chunk.state.value}, not free.")
        groups = self.inner.param_groups
        everything = [g["params"] for g in groups]
        try:
            for group, params in zip(groups, self._groups_of(chunk), strict=True):
                group["params"] = params
            self.inner.step()
        finally:
            for group, params in zip(groups, everything, strict=True):
                group["params"] = params
        for slot in chunk.slots:
            slot.param.grad = None
        chunk.clear_grad()
        self._stepped.add(chunk)

    def _reserve_states(self, module: ShardedModule) -> None:
        budget = module.manager.budget
        if budget is None:
            return
        defaults = self.inner.defaults
        if "betas" in defaults:  # Adam family: momentum and variance, maybe narrow
            narrow = parse_state_dtype(defaults.get("state_dtype", "fp32"))
            per_element = math.ceil(2 * moment_bytes(narrow))
        elif defaults.get("momentum") == 0:  # plain SGD keeps nothing
            per_element = 0
        else:  # one state (SGD momentum, Adagrad's sum, ...)
            per_element = 4
        elements = sum(c.shard_size for c in module.chunks if c.shard_on_device)
        budget.reserve(elements * per_element, "optimizer states")

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Unscale, check for overflow, clip and step; then clear the
        gradients [Note: step clears the gradients]."""
        loss = closure() if closure is not None else None
        if self.step_in_backward:  # done in backward [Note: stepping in backward]
            self._stepped.clear()
            self._step_clipped()
            return loss
        chunks = [c for c in self.module.chunks if c.grad_shard is not None]
        grads = [c.grad_shard for c in chunks if c.grad_shard is not None]
        device = self.module.manager.device
        max_norm = self._step_max_norm()
        groups, ranges = ((), None) if self.tp_group is None else self._tp_counts(chunks)
        try:
            ok, _ = unscale_clip_and_check(
                grads, self.module.comm, self.scaler, max_norm, device,
                count_ranges=ranges, model_parallel_groups=groups,
            )  # fmt: skip
        except NonFiniteGradientError:
            self._clear_grads()  # nothing stepped; the next step starts afresh
            self._step_clipped()
            raise
        self.last_step_skipped = not ok
        if ok:
            self.inner.step()
            if self.scaler is not None:
                self.scaler.update(False)
        self._clear_grads()
        self._step_clipped()
        return loss

    def _tp_counts(
        self, chunks: list[Chunk]
    ) -> tuple[tuple[dist.ProcessGroup, ...], list[list[tuple[int, int]]]]:
        """Under tensor parallelism: the group the norm also spans, and the
        elements of each gradient shard that count here (a split parameter
        on every tp rank, a replicated one on tp rank 0)."""
        assert self.tp_group is not None
        counts = counts_under_tensor_parallel(self.tp_group)
        ranges = []
        for chunk in chunks:
            begin = chunk.rank * chunk.shard_size
            mine = []
            for slot in chunk.slots:
                lo = max(slot.offset, begin)
                hi = min(slot.offset + slot.numel, begin + chunk.shard_size)
                if lo < hi and counts(slot.param):
                    mine.append((lo - begin, hi - begin))
            ranges.append(mine)
        return (self.tp_group,), ranges

    def _clear_grads(self) -> None:
        """[Note: step clears the gradients]: the exposed ``.grad`` and the
        chunks' gradient shards (their host buffers stay for the next step)."""
        self.zero_grad()
        for chunk in self.module.chunks:
            chunk.clear_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        scaler = state.pop("loss_scaler", None)
        if scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler)
        self.inner.load_state_dict(state)
        # torch swaps in new group and state objects: re-alias them.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
