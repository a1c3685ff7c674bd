"""What ZeRO-3's two wrappers share: a module whose parameters live as
shards in pc-chunk chunks, gathered around each use.

[Note: ZeRO-3 parameters]
Both :class:`~pc_zero.fsdp.FullyShardedDataParallel` (one chunk per wrapped
unit) and :class:`~pc_zero.gemini.GeminiDDP` (equal chunks in execution
order) hand their chunks to a :class:`~pc_chunk.ChunkManager` with exposed
shards: between steps each parameter *is* this rank's part of it (a flat,
possibly empty, fp32 tensor) and its ``.grad`` the matching part of the
averaged gradient. So the optimizer is built after wrapping, from
``model.parameters()``, with any param groups the user likes (by name, as
in the unwrapped model), and it steps the shards in place. Element-wise
optimizers (SGD, Adam, AdamW, ...) give exactly single-process results;
ones that need a whole tensor (LAMB's per-tensor trust ratio, Shampoo) do
not, as with torch FSDP's flat parameters. ``clip_grad_norm_`` all-reduces
the norm. ``summon_full_params()`` shows the full fp32 values.

[Note: build dtype]
The wrapper's mixed precision decides the compute dtype, and the masters
are fp32; the dtype the model was built in only carries its initial values.
Trainable parameters become fp32 master shards (pc-chunk upcasts bf16/fp16
values exactly as it packs them), so a model built in bf16 trains under
fp32 compute exactly as ``model.float()`` would, and under bf16 compute as
an fp32 model cast to bf16 with masters taken from the bf16 values.
Buffers and frozen parameters stay whole on every rank; those built
narrower than the compute dtype are upcast to it (exactly, as
``model.float()`` would), and none is rounded down.

[Note: optimizer state check]
A plain optimizer over the shards keeps per-rank state shaped like this
rank's shards, so its ``state_dict()`` is per rank (haiscale's FSDP
contract): each rank saves its own and loads its own back, and ranks whose
shards differ in size (they do: a parameter may be 33 elements on one rank
and 2 on another) resume exactly. Loading a state saved for another shard
(another rank's file, another world size or wrap policy) is accepted by
torch's ``load_state_dict`` without a look at the shapes, and the step then
fails deep in the optimizer ("the size of tensor a (2) must match ...") or,
where the sizes agree by chance, trains on the wrong values. So every
optimizer step is preceded by a check (a global optimizer step pre-hook,
registered once, since a wrapper never sees the optimizer built over its
parameters): when an optimizer's state dict object is new since its last
check (``load_state_dict`` makes a new one), every tensor entry of a shard
parameter's state must have the shard's shape, or the step raises a
``ValueError`` naming the parameter and saying how to resume. Between loads
the check is one dict lookup per optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from pc_chunk import Chunk, ChunkManager, ChunkState, is_lazy, materialize_
from pc_comm import Communicator, default_communicator
from pc_zero.loss_scale import unscale_clip_and_check
from pc_zero.memory import ModelStateMemory

__all__ = ["MixedPrecision", "ShardedModule"]


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype parameters are gathered in and compute
    runs in (the fp32 shard stays the master; None: fp32, whatever dtype
    the model was built in [Note: build dtype]); ``reduce_dtype``: the dtype
    gradients are averaged in; ``cast_forward_inputs``: floating-point
    inputs of the root forward are cast to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {value}.")


def _checked_device(wrapper: str, device: torch.device | str | int) -> torch.device:
    """``device`` as a torch.device this machine has, or a ValueError."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{wrapper}: device={device!r} is not a device ({error}); pass 'cpu', 'cuda', "
            "'cuda:N' or a torch.device."
        ) from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{wrapper}: device={device!r} is a CUDA device, but CUDA is not available here; "
            "pass device='cpu' or leave it None (where the parameters are)."
        )
    if target.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{wrapper}: device={device!r}: only 'cpu' and 'cuda' are supported.")
    if str(target) == "cuda":
        # The tensors made there say cuda:N; comparisons with a bare "cuda" fail.
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def prepare_module(
    module: nn.Module,
    wrapper: str,
    comm: Communicator | None,
    process_group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    sync_module_states: bool,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Communicator, torch.device, Callable[[nn.Parameter], None]]:
    """What both wrappers do first: pick the communicator, move the module
    to ``device`` (default: where its parameters are; lazy ones report where
    eager construction would have put them) and, with ``sync_module_states``,
    copy rank 0's parameters and buffers to every rank. Lazy parameters
    [Note: lazy parameters] are left for the chunk manager; returned is how
    it materialises each one (and broadcasts it under ``sync_module_states``).
    Buffers and frozen parameters built narrower than ``compute_dtype`` are
    upcast to it [Note: build dtype]."""
    comm = comm if comm is not None else default_communicator(process_group)
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{wrapper}: the module has no parameters.")
    meta = next((n for n, t in module.named_parameters() if t.is_meta and not is_lazy(t)), None)
    if meta is not None:
        raise ValueError(
            f"{wrapper}: parameter {meta!r} is on the meta device with no record of how it "
            "was initialised. Build the model inside pc_chunk.LazyInitContext() (it is then "
            "materialised shard by shard with eager construction's values), or give it real "
            "values first (module.to_empty(device=...) and reset_parameters())."
        )
    target = _checked_device(wrapper, device) if device is not None else params[0].device
    tensors = [*params, *module.buffers()]
    if not any(is_lazy(t) for t in tensors):
        module.to(target)
    else:
        for tensor in tensors:
            if is_lazy(tensor):
                # Buffers and frozen parameters are not sharded: whole now.
                if not isinstance(tensor, nn.Parameter) or not tensor.requires_grad:
                    materialize_(tensor, target)
            elif tensor.device != target:
                tensor.data = tensor.data.to(target)
    if sync_module_states:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not is_lazy(tensor):
                    comm.broadcast(tensor.data, 0)
    _upcast_whole_tensors(module, compute_dtype)

    def init_param(param: nn.Parameter) -> None:
        if is_lazy(param):
            materialize_(param, target)
            if sync_module_states:
                comm.broadcast(param.data, 0)

    return comm, target, init_param


def _upcast_whole_tensors(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """[Note: build dtype]: buffers and frozen parameters, which are not
    sharded, in at least the compute dtype (never rounded down)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    for tensor in [*module.buffers(), *frozen]:
        if tensor.is_floating_point():
            wider = torch.promote_types(tensor.dtype, compute_dtype)
            if wider != tensor.dtype:
                tensor.data = tensor.data.to(wider)


# [Note: optimizer state check]: shard parameter -> its name; optimizer ->
# id of the state dict it was last checked with; the hook's handle.
# (By identity: a tensor's == is element-wise.)
_SHARD_NAMES = WeakIdKeyDictionary()
_CHECKED = WeakIdKeyDictionary()
_STATE_CHECK: list[Any] = []  # the registered hook's handle, once


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """[Note: optimizer state check]: raise if a shard parameter's loaded
    state does not have the shard's shape."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = _SHARD_NAMES.get(param)  # type: ignore[no-untyped-call]
            if name is None:
                continue
            for key, value in optimizer.state.get(param, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and value.shape != param.shape
                ):
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {name!r} has shape "
                        f"{tuple(value.shape)}, but this rank's shard of the parameter has shape "
                        f"{tuple(param.shape)}: the optimizer state was saved for another shard "
                        "(another rank's file, another world size or another auto_wrap_policy). "
                        "A sharded model's optimizer state is per rank: each rank loads the "
                        "state_dict() it saved itself, at the same world size and wrapping. To "
                        "change those, load the model's full_state_dict() and start the "
                        "optimizer afresh."
                    )


def _check_before_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if _CHECKED.get(optimizer) != id(optimizer.state):  # type: ignore[no-untyped-call]
        check_optimizer_state(optimizer)
        _CHECKED[optimizer] = id(optimizer.state)


def _register_shards(names: dict[nn.Parameter, str]) -> None:
    for param, name in names.items():
        _SHARD_NAMES[param] = name
    if not _STATE_CHECK:
        hook = register_optimizer_step_pre_hook(_check_before_step)
        _STATE_CHECK.append(hook)


def _no_optimizer() -> None:
    raise RuntimeError(
        "step_in_backward=True steps each chunk in backward through the model's "
        "GeminiOptimizer, and none was built: wrap the optimizer with "
        "GeminiOptimizer(optimizer, model) before the first backward, or pass "
        "step_in_backward=False to step a plain optimizer after backward."
    )


class ShardedModule(nn.Module):
    """The module after wrapping [Note: ZeRO-3 parameters]. Subclasses
    build the :class:`~pc_chunk.ChunkManager`."""

    def __init__(
        self,
        module: nn.Module,
        manager: ChunkManager,
        comm: Communicator,
        mixed_precision: MixedPrecision | None,
        *,
        step_in_backward: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.manager = manager  # owns the chunks and drives them from hooks
        self.comm = comm
        self.mixed_precision = mixed_precision
        self._names = {p: n for n, p in module.named_parameters(remove_duplicate=False)}
        _register_shards(  # [Note: optimizer state check]
            {s.param: self._names.get(s.param, "?") for c in manager.chunks for s in c.slots}
        )
        # [Note: stepping in backward] (pc_zero.gemini): GeminiOptimizer
        # replaces the hook; until it does, a backward says it is missing.
        self.step_in_backward = step_in_backward
        if step_in_backward:
            for chunk in manager.chunks:
                chunk.keep_host_grad = False
            manager.on_backward_start = _no_optimizer
            manager.on_reduced = lambda _chunk: _no_optimizer()
        manager.attach()

    # -- running ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mp = self.mixed_precision
        if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
            dtype = mp.param_dtype

            def cast(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(dtype)
                return x

            args, kwargs = tree_map(cast, (args, kwargs))
        return self.module(*args, **kwargs)

    @property
    def chunks(self) -> list[Chunk]:
        return self.manager.chunks

    def _check_idle(self, what: str) -> None:
        busy = [c.name for c in self.chunks if c.state is not ChunkState.FREE]
        if busy:
            raise RuntimeError(
                f"{what} needs every chunk released, but {busy} are gathered: call it "
                "between steps, not inside forward or backward."
            )

    # -- gradients -------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient shards so the global norm is at most
        ``max_norm``; returns the norm before clipping (all ranks agree)."""
        if self.step_in_backward:
            raise RuntimeError(
                "clip_grad_norm_: with step_in_backward=True every chunk is already stepped "
                "when backward returns, so there is nothing left to clip; use "
                "step_in_backward=False to clip by the global norm."
            )
        grads = [c.grad_shard for c in self.chunks if c.grad_shard is not None]
        device = self.manager.device
        _, norm = unscale_clip_and_check(grads, self.comm, None, float(max_norm), device)
        return norm

    # -- full values -------------------------------------------------------------------------

    @contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Inside, every parameter holds its full value in the shard dtype
        (fp32 masters); with ``writeback`` changes made inside are kept."""
        self._check_idle("summon_full_params()")
        fulls: list[torch.Tensor] = []
        # Which exposed gradients were dropped (zero_grad(set_to_none=True)):
        # re-pointing afterwards must not bring their stale shards back.
        dropped = [slot.param for c in self.chunks for slot in c.slots if slot.param.grad is None]
        for chunk in self.chunks:
            assert chunk.shard is not None
            full = torch.empty(chunk.size, dtype=chunk.shard_dtype, device=chunk.device)
            self.comm.all_gather(full, chunk.shard.to(chunk.device))
            fulls.append(full)
            for slot in chunk.slots:
                slot.param.grad = None
                slot.param.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        try:
            yield
        finally:
            for chunk, full in zip(self.chunks, fulls, strict=True):
                assert chunk.shard is not None
                if writeback:
                    lo = chunk.rank * chunk.shard_size
                    chunk.shard.copy_(full[lo : lo + chunk.shard_size])
                chunk.repoint()
            for param in dropped:
                param.grad = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped module's state dict with full fp32 values, on every rank."""
        with self.summon_full_params(writeback=False):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Every rank keeps its shard of the full values in ``state_dict``."""
        with self.summon_full_params(writeback=True):
            self.module.load_state_dict(state_dict)

    # -- accounting --------------------------------------------------------------------------

    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> ModelStateMemory:
        """Model-state bytes this rank holds between steps: shards (the
        fp32 masters), gradient shards (and host gradient buffers kept for
        the next step) and the optimizer's states."""
        params = grads = host = 0
        for chunk in self.chunks:
            assert chunk.shard is not None
            params += chunk.shard_bytes
            host += chunk.shard_bytes if chunk.shard.device.type == "cpu" else 0
            held = chunk.held_grad  # a host buffer kept between steps counts too
            if held is not None:
                nbytes = held.numel() * held.element_size()
                grads += nbytes
                host += nbytes if held.device.type == "cpu" else 0
        states = 0
        if optimizer is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        nbytes = value.numel() * value.element_size()
                        states += nbytes
                        host += nbytes if value.device.type == "cpu" else 0
        # fp32 shards are the masters: counted once, as master.
        return ModelStateMemory(0, grads, params, states, host)

    def name_of(self, param: nn.Parameter) -> str:
        return self._names[param]
