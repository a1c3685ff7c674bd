"""ZeRO-3 by chunks (Colossal-AI's Gemini): :class:`GeminiDDP` and
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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_chunk import (
    BudgetExceededError,
    Chunk,
    ChunkManager,
    ChunkState,
    DeviceBudget,
    MemoryTracer,
    StaticPlacement,
    search_chunk_size,
)
from pc_chunk.manager import execution_order
from pc_comm import Communicator
from pc_offload import CopyEngine, PinnedPool
from pc_zero.loss_scale import DynamicLossScaler, LossScaleConfig, unscale_clip_and_check
from pc_zero.sharded import MixedPrecision, ShardedModule, prepare_module

__all__ = ["GeminiDDP", "GeminiOptimizer"]

# Optimizer state bytes per element that "auto" placement plans for (Adam:
# momentum and variance in fp32).
_STATE_BYTES = 8


class GeminiDDP(ShardedModule):
    """ZeRO-3 over chunks [Note: Gemini]. ``mixed_precision`` is the compute
    dtype (fp32 masters stay in the shards, whatever dtype the model was
    built in: [Note: build dtype] in pc_zero.sharded); fp16 needs
    :class:`GeminiOptimizer` for loss scaling. Build the optimizer after
    wrapping, over ``model.parameters()``."""

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device | str | None = None,
        placement_policy: Literal["static", "auto"] = "static",
        offload_param_frac: float = 0.0,
        device_budget_bytes: int | None = None,
        mixed_precision: torch.dtype = torch.float32,
        chunk_size: int | None = None,
        search_range: int = 32 * 1024 * 1024,
        min_chunk_size: int = 32 * 1024 * 1024,
        example_inputs: tuple[Any, ...] = (),
        process_group: dist.ProcessGroup | None = None,
        comm: Communicator | None = None,
        sync_module_states: bool = False,
        prefetch: bool = True,
        step_in_backward: bool = False,
    ) -> None:
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"placement_policy must be 'static' or 'auto', got {placement_policy!r}."
            )
        if placement_policy == "auto" and device_budget_bytes is None:
            raise ValueError(
                "placement_policy='auto' plans against a device budget: pass "
                "device_budget_bytes (e.g. the GPU's free memory)."
            )
        if not 0.0 <= offload_param_frac <= 1.0:
            raise ValueError(f"offload_param_frac must be in [0, 1], got {offload_param_frac}.")
        for name, value in (("device_budget_bytes", device_budget_bytes),
                            ("chunk_size", chunk_size)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):  # fmt: skip
                raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
        comm, device, init_param = prepare_module(
            module, "GeminiDDP", comm, process_group, device, sync_module_states, mixed_precision
        )
        world = comm.world_size
        order = [p for p in execution_order(module, *example_inputs) if p.requires_grad]
        total = sum(p.numel() for p in order)
        if chunk_size is not None and chunk_size > 2 * max(total, 1024):
            raise ValueError(
                f"chunk_size {chunk_size} is more than twice the whole model ({total} trainable "
                f"elements): one chunk would be mostly padding. Use chunk_size <= {total} "
                "(rounded up as you need), or None to search for the size with the least padding."
            )
        if chunk_size is None:
            # From min_chunk_size (never below the largest parameter, never
            # above the whole model) up by search_range.
            largest = max(p.numel() for p in order)
            low = max(largest, min(min_chunk_size, total))
            quantum = 64 * world
            low = -(-low // quantum) * quantum
            chunk_size = search_chunk_size(order, search_range, low, quantum).chunk_size
        self.budget = DeviceBudget(device_budget_bytes) if device_budget_bytes is not None else None
        if placement_policy == "auto":
            assert device_budget_bytes is not None
            non_model = _non_model_peak(module, example_inputs) if example_inputs else 0
            offload_param_frac = _auto_offload_fraction(
                order,
                chunk_size,
                world,
                device_budget_bytes,
                non_model,
                mixed_precision,
                step_in_backward,
            )
        self.offload_param_frac = offload_param_frac
        try:
            manager = ChunkManager(
                module,
                example_inputs=example_inputs,
                chunk_size=chunk_size,
                comm=comm,
                device=device,
                budget=self.budget,
                placement=StaticPlacement(1.0 - offload_param_frac),
                engine=CopyEngine(PinnedPool()) if device.type == "cuda" else None,
                compute_dtype=mixed_precision,
                expose_shards=True,
                prefetch=prefetch,
                init_param=init_param,
            )
        except BudgetExceededError as error:  # the placement asked for cannot fit: a setting
            raise ValueError(
                f"GeminiDDP: device_budget_bytes={device_budget_bytes} cannot hold the chunks "
                f"placement_policy={placement_policy!r} keeps on the device ({error})"
            ) from None
        if self.budget is not None:
            # Forward gathers a whole chunk in the compute dtype: a budget
            # without room for one after the resident shards can never run.
            gathered = chunk_size * torch.empty((), dtype=mixed_precision).element_size()
            if self.budget.available_bytes < gathered:
                raise ValueError(
                    f"GeminiDDP: device_budget_bytes={device_budget_bytes} leaves "
                    f"{self.budget.available_bytes} bytes after the resident shards, but "
                    f"gathering one chunk ({chunk_size} elements) needs {gathered}. Raise the "
                    "budget, keep more on the host (offload_param_frac, or placement 'auto'), "
                    "or use a smaller chunk_size."
                )
        mp = MixedPrecision(mixed_precision) if mixed_precision != torch.float32 else None
        super().__init__(module, manager, comm, mp, step_in_backward=step_in_backward)


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
    order: list[nn.Parameter],
    chunk_size: int,
    world: int,
    budget: int,
    non_model: int,
    compute_dtype: torch.dtype,
    step_in_backward: bool = False,
) -> float:
    """The host fraction of chunks for "auto" [Note: Gemini]: the working set
    first, then as many chunks' shard + gradient shard + states as fit.
    Stepping in backward keeps no gradient shard per chunk, but up to two
    in the working set [Note: stepping in backward]."""
    total = sum(p.numel() for p in order)
    chunks = max(1, math.ceil(total / chunk_size))
    working = 2 * chunk_size * compute_dtype.itemsize + chunk_size * 4 + non_model
    grad_shard = chunk_size // world * 4
    if step_in_backward:
        working += 2 * grad_shard
    per_chunk = chunk_size // world * (4 + _STATE_BYTES) + (0 if step_in_backward else grad_shard)
    fit = max(0, (budget - working) // per_chunk)
    return 1.0 - min(chunks, fit) / chunks


class GeminiOptimizer(Optimizer):
    """Wraps a torch optimizer built over a :class:`GeminiDDP`'s parameters:
    loss scaling for fp16 (:class:`~pc_zero.LossScaleConfig`), an overflow
    check across ranks that skips the step, and global-norm clipping
    (``max_norm``), shared with ZeRO-1/2. Call ``optimizer.backward(loss)``.
    Under ``GeminiDDP(step_in_backward=True)`` it steps chunk by chunk inside
    backward [Note: stepping in backward]."""

    def __init__(
        self,
        optimizer: Optimizer,
        module: ShardedModule,
        *,
        max_norm: float = 0.0,
        loss_scale: LossScaleConfig | None = None,
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
        mp = module.mixed_precision
        fp16 = mp is not None and mp.param_dtype == torch.float16
        self.scaler = DynamicLossScaler(loss_scale) if fp16 else None
        self._reserve_states(module)
        super().__init__([{"params": [torch.zeros(1)]}], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._stepped: set[Chunk] = set()  # chunks stepped since the last step()
        if self.step_in_backward:
            self._check_step_in_backward(fp16)
            module.manager.on_backward_start = self._check_stepped
            module.manager.on_reduced = self._step_chunk

    # -- [Note: stepping in backward] --------------------------------------------------

    @property
    def step_in_backward(self) -> bool:
        return self.module.step_in_backward

    def _check_step_in_backward(self, fp16: bool) -> None:
        refused = []
        if self.max_norm > 0:
            refused.append(f"global-norm clipping (max_norm={self.max_norm})")
        if fp16:
            refused.append("fp16 loss scaling (mixed_precision=torch.float16)")
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
        if "betas" in defaults:  # Adam family: momentum and variance
            per_element = _STATE_BYTES
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
        loss = closure() if closure is not None else None
        if self.step_in_backward:  # done in backward [Note: stepping in backward]
            self._stepped.clear()
            return loss
        grads = [c.grad_shard for c in self.module.chunks if c.grad_shard is not None]
        device = self.module.manager.device
        ok, _ = unscale_clip_and_check(grads, self.module.comm, self.scaler, self.max_norm, device)
        if not ok:
            self.zero_grad()
            return loss
        self.inner.step()
        if self.scaler is not None:
            self.scaler.update(False)
        return loss

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
