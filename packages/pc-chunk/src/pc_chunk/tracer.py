"""Non-model memory per operator, recorded during a warm-up step.

[Note: tracing]
``MemoryTracer(model).trace(fn)`` runs ``fn`` (a forward and backward)
under a dispatch mode that sees every aten operator. After each operator it
records the bytes the operator allocated and the non-model bytes alive at
that moment, and which module was running.

- On CUDA the figures come from the caching allocator
  (``torch.cuda.memory_allocated``), minus the model data (parameters and
  gradients) alive at that moment.
- On the CPU, where no allocator statistics exist, they come from an
  accounting of tensor storages: each storage an operator returns that was
  not seen before counts as allocated, and a weak reference to it takes it
  off the live total when it is freed. Parameter and gradient storages are
  model data and never count.

``non_model_bytes()`` gives, per module, the peak non-model memory while it
ran: the figures :class:`~pc_chunk.manager.AutoPlacement` makes room for.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracer", "OpRecord"]

T = TypeVar("T")


@dataclass(frozen=True)
class OpRecord:
    """One operator call: what it allocated and what non-model memory was
    alive after it, in bytes."""

    op: str
    module: str
    allocated_bytes: int
    live_bytes: int


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, tracer: MemoryTracer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracer = tracer

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        before = self.tracer._device_allocated()
        out = func(*args, **(kwargs or {}))
        self.tracer._after_op(str(func.overloadpacket.__name__), out, before)
        return out


class MemoryTracer:
    """Records non-model memory per operator [Note: tracing]."""

    def __init__(self, model: nn.Module, device: torch.device | str | None = None) -> None:
        self.model = model
        first = next(model.parameters(), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.records: list[OpRecord] = []
        self._live: dict[int, int] = {}  # storage address -> bytes (CPU accounting)
        self._live_bytes = 0
        self._modules: list[str] = []

    # -- model data -----------------------------------------------------------

    def _model_storages(self) -> set[int]:
        found = set()
        for param in self.model.parameters():
            found.add(param.untyped_storage().data_ptr())
            if param.grad is not None:
                found.add(param.grad.untyped_storage().data_ptr())
        return found

    def _model_bytes(self) -> int:
        total = 0
        for param in self.model.parameters():
            total += param.untyped_storage().nbytes()
            if param.grad is not None:
                total += param.grad.untyped_storage().nbytes()
        return total

    # -- accounting -------------------------------------------------------------

    def _device_allocated(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return 0

    def _freed(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self._live_bytes -= nbytes

    def _after_op(self, op: str, out: Any, before: int) -> None:
        module = self._modules[-1] if self._modules else ""
        if self.device.type == "cuda":
            after = self._device_allocated()
            live = after - self._model_bytes()
            self.records.append(OpRecord(op, module, max(0, after - before), live))
            return
        model = self._model_storages()
        allocated = 0
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            nbytes = storage.nbytes()
            if key in self._live or key in model or nbytes == 0:
                continue
            self._live[key] = nbytes
            self._live_bytes += nbytes
            allocated += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
        self.records.append(OpRecord(op, module, allocated, self._live_bytes))

    # -- running -----------------------------------------------------------------

    def trace(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one training step) and record every operator."""
        names = {m: n for n, m in self.model.named_modules()}
        hooks = []

        def enter(module: nn.Module, _args: Any) -> None:
            self._modules.append(names[module] or "<root>")

        def leave(module: nn.Module, _args: Any, _out: Any) -> None:
            if self._modules:
                self._modules.pop()

        for module in self.model.modules():
            hooks.append(module.register_forward_pre_hook(enter))
            hooks.append(module.register_forward_hook(leave))
        try:
            with _Mode(self):
                return fn()
        finally:
            for hook in hooks:
                hook.remove()
            self._modules = []

    def non_model_bytes(self) -> dict[str, int]:
        """Peak non-model bytes alive while each module ran (forward),
        counting the operators of its submodules."""
        peaks: dict[str, int] = {}
        for record in self.records:
            if not record.module:
                continue
            parts = record.module.split(".")
            for depth in range(1, len(parts) + 1):
                name = ".".join(parts[:depth])
                peaks[name] = max(peaks.get(name, 0), record.live_bytes)
        return peaks

    def allocated_by_op(self) -> dict[str, int]:
        """Total bytes each operator allocated over the traced step."""
        totals: dict[str, int] = {}
        for record in self.records:
            totals[record.op] = totals.get(record.op, 0) + record.allocated_bytes
        return totals
