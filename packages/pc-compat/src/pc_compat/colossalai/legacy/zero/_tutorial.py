"""Colossal-AI's Gemini API on pc: the names and call shapes of its
"ZeRO with chunk-based memory management" tutorial, so a program written for
it runs with its imports changed. Everything here is a thin layer over
:class:`~pc_zero.GeminiDDP` and :class:`~pc_zero.GeminiOptimizer`; what pc
does differently is refused with a ``ValueError`` that says what to do
instead, never accepted and ignored.

[Note: Colossal-AI's Gemini objects]
Colossal-AI builds ZeRO-3 in three objects: a ``ChunkManager`` (the chunk
size, the process group, whether chunks are sharded and where they start),
a ``GeminiManager`` (the placement policy over it) and ``ZeroDDP(model,
gemini_manager)``. In pc the chunk manager proper
(:class:`pc_chunk.ChunkManager`) needs the model, so here
:class:`ChunkManager` and :class:`GeminiManager` are the settings, checked
when they are made, and :class:`ZeroDDP` builds the
:class:`~pc_zero.GeminiDDP` they describe, computing on the accelerator's
current device as Colossal-AI does. Sizes are in elements.

- ``ChunkManager(chunk_size, process_group, enable_distributed_storage,
  init_device)``: ``chunk_size=None`` is one chunk per tensor; a size that
  does not divide by the group size is rounded up to a multiple of it, so
  every rank owns an equal shard; a parameter larger than the size gets a
  chunk of its own ([Note: oversized parameters] in pc_chunk.manager).
  Chunks are always sharded in pc, so ``enable_distributed_storage=False``
  (every rank keeping whole chunks) is refused on a group of more than one
  rank, where it would mean something else. ``init_device`` is where chunk
  shards rest: it must be where the placement policy keeps them
  (``GeminiManager.get_default_device(policy)``).
- ``ChunkManager.search_chunk_size(model, search_range, n_grids,
  min_chunk_size, filter_exlarge_params)`` is Colossal-AI's grid search
  ([Note: grid search] in pc_chunk.search).
- ``init_chunk_manager(model=, init_device=, hidden_dim=,
  search_range_mb=, min_chunk_size_mb=, filter_exlarge_params=,
  verbose=)`` searches as Colossal-AI does: sizes in units of 2**20
  elements, the step ``hidden_dim`` (default 1024), very large parameters
  left out of the search (they get chunks of their own) and a model smaller
  than ``min_chunk_size_mb`` packed into one chunk (sharded in pc, where
  Colossal-AI keeps that chunk whole on every rank).
- ``GeminiManager(placement_policy, chunk_manager)``: "cuda", "cpu",
  "auto" and pc's "static" ([Note: placement policies] in pc_zero.gemini).
- ``ZeroDDP(model, gemini_manager, pin_memory=, force_outputs_fp32=)``;
  Colossal-AI's ZeroDDP computes in fp16, pc's in fp32 unless
  ``mixed_precision=torch.float16`` (or bf16) is passed.
- ``ZeroOptimizer(optimizer, model, initial_scale=, ..., clipping_norm=,
  verbose=)`` and ``GeminiAdamOptimizer(model, lr=, ..., initial_scale=)``
  (a :class:`~pc_offload.HybridAdam` inside): ``optimizer.backward(loss)``
  then ``optimizer.step()``, which leaves the gradients cleared ([Note:
  step clears the gradients] in pc_zero.gemini). The loss scale applies in
  every precision, as Colossal-AI's does ([Note: loss scaling in every
  precision]).
- ``ColoInitContext(device=, dtype=)``: the model built inside has its
  parameters and buffers made on ``device`` in ``dtype`` (torch's default
  device and dtype for the duration); with ``lazy=True`` it is built through
  :class:`pc_chunk.LazyInitContext` and materialised chunk by chunk by
  the wrapper. Colossal-AI's tensor-parallel specs (``default_pg``,
  ``default_dist_spec``) are refused: pc's tensor parallelism is pc-tensor.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_chunk import ChunkManager as _PcChunkManager
from pc_chunk import LazyInitContext, filter_exlarge_sizes, packing_waste
from pc_offload import HybridAdam
from pc_zero import (
    GeminiDDP,
    GeminiOptimizer,
    LossScaleConfig,
    PlacementPolicy,
    searched_chunk_size,
)

__all__ = [
    "ChunkManager",
    "ColoInitContext",
    "GeminiAdamOptimizer",
    "GeminiManager",
    "ZeroDDP",
    "ZeroOptimizer",
    "init_chunk_manager",
]

_MEGA = 1024 * 1024


def _compute_device() -> torch.device:
    """Where Colossal-AI computes: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_size(process_group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        raise ValueError(
            "the process group is not initialised: start it first "
            "(pc_comm.init_distributed(), or torch.distributed.init_process_group)."
        )
    return dist.get_world_size(process_group)


class ChunkManager:
    """Colossal-AI's ``ChunkManager(chunk_size, process_group,
    enable_distributed_storage, init_device)`` as settings [Note:
    Colossal-AI's Gemini objects]; :class:`ZeroDDP` builds the chunks."""

    search_chunk_size = staticmethod(_PcChunkManager.search_chunk_size)

    def __init__(
        self,
        chunk_size: int | None,
        process_group: dist.ProcessGroup | None = None,
        enable_distributed_storage: bool = False,
        init_device: torch.device | str | None = None,
    ) -> None:
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"process_group must be a torch.distributed ProcessGroup (or None: every "
                f"rank), got {type(process_group).__name__}. pc has no ColoProcessGroup; "
                "tensor parallelism is pc-tensor's (HybridParallelPlugin(tp_size=...))."
            )
        world = _group_size(process_group)
        if not enable_distributed_storage and world > 1:
            raise ValueError(
                "ChunkManager(enable_distributed_storage=False) keeps whole chunks on every "
                f"rank; pc's chunks are always sharded over the group ({world} ranks), which "
                "gives the same training at a 1/N of the memory. Pass "
                "enable_distributed_storage=True, or use pc_comm.DistributedDataParallel for "
                "replicated parameters."
            )
        # What the chunks are built with: a multiple of the group size, so
        # every rank owns an equal shard.
        self.chunk_size = None if chunk_size is None else -(-chunk_size // world) * world
        self.process_group = process_group
        self.enable_distributed_storage = enable_distributed_storage
        self.init_device = torch.device(init_device) if init_device is not None else None
        self.world_size = world

    def __repr__(self) -> str:
        return (
            f"ChunkManager(chunk_size={self.chunk_size}, world_size={self.world_size}, "
            f"init_device={self.init_device})"
        )


def init_chunk_manager(
    model: nn.Module,
    init_device: torch.device | str | None = None,
    hidden_dim: int | None = None,
    verbose: bool = False,
    *,
    search_range_mb: float,
    min_chunk_size_mb: float = 32,
    filter_exlarge_params: bool = True,
    strict_ddp_flag: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> ChunkManager:
    """Colossal-AI's chunk search [Note: Colossal-AI's Gemini objects]: the
    chunk size with the least padding for ``model``'s parameters (module
    order), as a :class:`ChunkManager`."""
    if strict_ddp_flag:
        raise ValueError(
            "init_chunk_manager(strict_ddp_flag=True) keeps every parameter whole on every "
            "rank; pc's chunks are always sharded. Use pc_comm.DistributedDataParallel for "
            "plain data parallelism."
        )
    world = _group_size(process_group)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if not sizes:
        raise ValueError("init_chunk_manager: the model has no trainable parameters.")
    total = sum(sizes)
    search_range = _mega("search_range_mb", search_range_mb)
    min_chunk_size = _mega("min_chunk_size_mb", min_chunk_size_mb)
    searched = filter_exlarge_sizes(sizes) if filter_exlarge_params else sizes
    step = 1024 if hidden_dim is None else hidden_dim
    if total < min_chunk_size:  # everything in one small chunk
        chunk_size = -(-total // world) * world
    else:
        chunk_size = searched_chunk_size(searched, world, search_range, min_chunk_size, step)
    if verbose and dist.get_rank(process_group) == 0:
        # As Colossal-AI reports it: the padding of the parameters searched over.
        chunks, wasted = packing_waste(searched, chunk_size)
        print(
            f"pc: searched chunk size {chunk_size} elements ({chunks} chunks for the "
            f"parameters searched over); used number: {total / _MEGA:.2f} * 2^20, wasted "
            f"number: {wasted / _MEGA:.2f} * 2^20 "
            f"({100 * wasted / max(1, total + wasted):.2f}%)",
            flush=True,
        )
    return ChunkManager(chunk_size, process_group, True, init_device)


def _mega(name: str, value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (units of 2**20 elements), got {value!r}.")
    return round(value * _MEGA)


class GeminiManager:
    """Colossal-AI's ``GeminiManager(placement_policy, chunk_manager)`` as
    settings [Note: Colossal-AI's Gemini objects]. ``offload_param_frac``
    (for "static") and ``device_budget_bytes`` (for "auto"; default: the
    GPU's free memory) are :class:`~pc_zero.GeminiDDP`'s."""

    def __init__(
        self,
        placement_policy: str,
        chunk_manager: ChunkManager,
        memstats: Any = None,
        *,
        offload_param_frac: float = 0.0,
        device_budget_bytes: int | None = None,
    ) -> None:
        self.policy = PlacementPolicy.parse(placement_policy)
        if not isinstance(chunk_manager, ChunkManager):
            raise ValueError(
                "GeminiManager needs a pc_compat.colossalai.legacy.zero.ChunkManager (or "
                "init_chunk_manager's "
                f"result), got {type(chunk_manager).__name__}."
            )
        if memstats is not None:
            raise ValueError(
                "GeminiManager(memstats=...): pc has no Colossal-AI MemStats; its 'auto' "
                "placement measures non-model memory itself (GeminiDDP(example_inputs=...))."
            )
        self.chunk_manager = chunk_manager
        self.offload_param_frac = offload_param_frac
        self.device_budget_bytes = device_budget_bytes

    @property
    def policy_name(self) -> str:
        return self.policy.value

    @staticmethod
    def get_default_device(policy_name: str) -> torch.device:
        """Where ``policy_name`` keeps chunk shards: the host for "cpu", the
        compute device otherwise (the accelerator's current device)."""
        policy = PlacementPolicy.parse(policy_name)
        return torch.device("cpu") if policy is PlacementPolicy.CPU else _compute_device()


class ZeroDDP(GeminiDDP):
    """Colossal-AI's ``ZeroDDP(module, gemini_manager)``: the
    :class:`~pc_zero.GeminiDDP` its managers describe [Note: Colossal-AI's
    Gemini objects]."""

    def __init__(
        self,
        module: nn.Module,
        gemini_manager: GeminiManager,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        *,
        mixed_precision: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(gemini_manager, GeminiManager):
            raise ValueError(
                f"ZeroDDP needs a pc_zero.GeminiManager, got {type(gemini_manager).__name__}."
            )
        if strict_ddp_mode:
            raise ValueError(
                "ZeroDDP(strict_ddp_mode=True) keeps every parameter whole on every rank; pc's "
                "chunks are always sharded. Use pc_comm.DistributedDataParallel for that."
            )
        chunks = gemini_manager.chunk_manager
        device = _compute_device()
        policy = gemini_manager.policy
        where = GeminiManager.get_default_device(policy.value)
        if chunks.init_device is not None and not _same_device(chunks.init_device, where):
            raise ValueError(
                f"ZeroDDP: the ChunkManager's init_device={chunks.init_device} is not where "
                f"placement_policy={policy.value!r} keeps chunk shards ({where}). Pass "
                f"init_device=None or GeminiManager.get_default_device({policy.value!r}), or "
                "choose the placement policy that keeps them there."
            )
        super().__init__(
            module,
            device=device,
            placement_policy=policy,
            pin_memory=pin_memory,
            offload_param_frac=gemini_manager.offload_param_frac,
            device_budget_bytes=gemini_manager.device_budget_bytes,
            mixed_precision=mixed_precision,
            chunk_size=chunks.chunk_size,
            chunk_per_tensor=chunks.chunk_size is None,
            force_outputs_fp32=force_outputs_fp32,
            process_group=chunks.process_group,
        )
        self.gemini_manager = gemini_manager


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index = a.index if a.index is not None else torch.cuda.current_device()
    return index == (b.index if b.index is not None else torch.cuda.current_device())


class ZeroOptimizer(GeminiOptimizer):
    """Colossal-AI's ``ZeroOptimizer(optim, module, ...)``: its dynamic loss
    scale (in every precision [Note: loss scaling in every precision]),
    ``clipping_norm`` as the global-norm clip, ``verbose`` printing each
    skipped step."""

    def __init__(
        self,
        optim: Optimizer,
        module: nn.Module,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        clipping_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
    ) -> None:
        if gpu_margin_mem_ratio:
            raise ValueError(
                f"gpu_margin_mem_ratio={gpu_margin_mem_ratio}: pc does not move optimizer "
                "states into spare GPU memory after the first step; its 'auto' placement plans "
                "the device at construction (GeminiManager('auto', ..., device_budget_bytes=))."
            )
        if norm_type != 2.0:
            raise ValueError(
                f"norm_type={norm_type}: pc clips by the L2 norm only (norm_type=2.0)."
            )
        if not isinstance(module, GeminiDDP):
            raise ValueError(
                f"ZeroOptimizer needs the wrapped model (ZeroDDP / GeminiDDP), got "
                f"{type(module).__name__}."
            )
        scale = LossScaleConfig(
            initial_scale=float(initial_scale),
            min_scale=float(min_scale),
            max_scale=float(max_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            hysteresis=int(hysteresis),
        )
        super().__init__(
            optim, module, max_norm=clipping_norm, loss_scale=scale, scale_every_precision=True
        )
        self.verbose = verbose

    def step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().step(*args, **kwargs)
        if self.verbose and self.last_step_skipped:
            print(f"pc: found overflow, skipped the step (loss scale now {self.loss_scale})")
        return loss


class GeminiAdamOptimizer(ZeroOptimizer):
    """Colossal-AI's ``GeminiAdamOptimizer(model, lr=, ..., initial_scale=)``:
    a :class:`~pc_offload.HybridAdam` over ``model``'s parameters inside a
    :class:`ZeroOptimizer`."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        *,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        clipping_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
    ) -> None:
        adam = HybridAdam(
            model.parameters(),
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
        )
        super().__init__(
            adam,
            model,
            gpu_margin_mem_ratio=gpu_margin_mem_ratio,
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
            clipping_norm=clipping_norm,
            norm_type=norm_type,
            verbose=verbose,
        )


class ColoInitContext:
    """Colossal-AI's ``with ColoInitContext(device=...): model = ...``
    [Note: Colossal-AI's Gemini objects]: tensors made inside are made on
    ``device`` in ``dtype`` (floating ones), or, with ``lazy=True``, recorded
    by :class:`pc_chunk.LazyInitContext` for the wrapper to materialise
    chunk by chunk (on ``device``, unless the wrapper is given another)."""

    def __init__(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float,
        default_pg: Any = None,
        default_dist_spec: Any = None,
        *,
        lazy: bool = False,
    ) -> None:
        if default_pg is not None or default_dist_spec is not None:
            raise ValueError(
                "ColoInitContext(default_pg=, default_dist_spec=): pc builds plain torch "
                "parameters; tensor parallelism is pc-tensor's (HybridParallelPlugin("
                "tp_size=...) or pc_tensor's plans). Drop these arguments."
            )
        if not dtype.is_floating_point:
            raise ValueError(f"ColoInitContext(dtype=) must be a floating dtype, got {dtype}.")
        target = torch.device(device) if device is not None else None
        if target is not None and target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"ColoInitContext(device={device!r}): CUDA is not available here; pass "
                "device='cpu' or get_accelerator().get_current_device()."
            )
        self.device = target
        self.dtype = dtype
        self.lazy = lazy
        self._stack: contextlib.ExitStack | None = None
        self._dtype_before: torch.dtype | None = None

    def __enter__(self) -> ColoInitContext:
        if self._stack is not None:
            raise RuntimeError("ColoInitContext is already entered; it cannot be nested in itself.")
        stack = contextlib.ExitStack()
        self._dtype_before = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        stack.callback(torch.set_default_dtype, self._dtype_before)
        if self.device is not None:
            stack.enter_context(self.device)
        if self.lazy:
            stack.enter_context(LazyInitContext())
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        assert stack is not None, "ColoInitContext exited without being entered"
        stack.close()
