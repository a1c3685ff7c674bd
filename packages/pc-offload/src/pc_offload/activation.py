"""Activation CPU offload: ``with CPUOffload(offload_ratio=0.5): loss = model(x)``.

[Note: which activations move]
Inside the context, every tensor autograd saves for backward passes through
a pack hook. A tensor is a candidate when it is floating point, at least
``min_bytes`` large, and not a parameter (a leaf that requires grad, or a
view of one: parameters stay resident anyway, copying them frees nothing).
Candidates are taken in the order the forward saves them, earliest first,
until the offloaded bytes reach ``offload_ratio`` times the bytes the
previous forward under the same ``tag`` saved. The earliest activations are
the ones backward needs last, so their copies back have the most time to
finish. In the first forward of a tag the total is not known yet; there a
candidate moves when the running offloaded share stays within the ratio.
Ratio 0 moves nothing, ratio 1 moves every candidate.

[Note: copies]
On CUDA the copy to the host runs on a side stream into pinned memory from a
:class:`~pc_offload.pool.PinnedPool`, ordered after the kernel that produced
the tensor, so forward does not wait for it; the device memory is released
as soon as the copy is done. In backward, unpacking one offloaded tensor
starts the copies back of the next ``prefetch`` tensors backward will need
(earlier-saved ones), so they overlap the current node's compute. A host
buffer returns to the pool when autograd frees the saved tensor. On the CPU
the same path runs with immediate copies, which is how it is tested here.

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant)
composes: inside a checkpointed region checkpoint's own hooks take over and
nothing is saved for our hooks to move; outside it, activations move as
above.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from pc_offload.pool import CopyEngine, Transfer

__all__ = ["CPUOffload", "OffloadStats"]

_TOTALS: dict[str, int] = {}  # bytes saved by the last forward, per tag
_DEFAULT_ENGINE: list[CopyEngine] = []


def _default_engine() -> CopyEngine:
    if not _DEFAULT_ENGINE:
        _DEFAULT_ENGINE.append(CopyEngine())
    return _DEFAULT_ENGINE[0]


@dataclass(frozen=True)
class OffloadStats:
    """What one forward under :class:`CPUOffload` saved and moved."""

    saved_bytes: int
    offloaded_bytes: int
    offloaded_tensors: int
    kept_tensors: int


class _Offloaded:
    """A saved tensor that lives on the host until backward needs it."""

    def __init__(self, engine: CopyEngine, tensor: torch.Tensor, index: int) -> None:
        self.engine = engine
        self.device = tensor.device
        self.index = index
        self.to_host = engine.to_host(tensor)
        self.to_device: Transfer | None = None
        host = self.to_host.result
        transfer = self.to_host
        weakref.finalize(self, engine.release_after, transfer, host)

    def prefetch(self) -> None:
        if self.to_device is None:
            self.to_host.wait()
            self.to_device = self.engine.to_device(self.to_host.result, self.device)

    def take(self) -> torch.Tensor:
        self.prefetch()
        assert self.to_device is not None
        tensor = self.to_device.wait()
        self.to_device = None  # a second backward (retain_graph) copies again
        return tensor


class CPUOffload:
    """Move a share of the activations saved during forward to host memory,
    and bring them back for backward [Note: which activations move].

    ``offload_ratio`` in [0, 1] is the share of saved bytes to move; ``tag``
    names the forward region whose previous total calibrates the ratio (use
    one tag per distinct region, e.g. per pipeline stage). ``enable=False``
    makes the context a no-op. ``stats`` describes the last forward.
    """

    def __init__(
        self,
        offload_ratio: float = 1.0,
        tag: str = "default",
        *,
        enable: bool = True,
        min_bytes: int = 1024,
        prefetch: int = 2,
        engine: CopyEngine | None = None,
    ) -> None:
        if not 0.0 <= offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in [0, 1], got {offload_ratio}.")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}.")
        self.offload_ratio = offload_ratio
        self.tag = tag
        self.enable = enable
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.engine = engine
        self.stats = OffloadStats(0, 0, 0, 0)
        self._hooks: Any = None
        self._records: list[weakref.ref[_Offloaded]] = []  # weak: autograd owns them
        self._saved = 0
        self._offloaded = 0
        self._kept = 0
        self._budget: int | None = None

    def __enter__(self) -> CPUOffload:
        if not self.enable:
            return self
        self._records, self._saved, self._offloaded, self._kept = [], 0, 0, 0
        previous = _TOTALS.get(self.tag)
        self._budget = None if previous is None else int(self.offload_ratio * previous)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(kind, error, traceback)
        self._hooks = None
        _TOTALS[self.tag] = self._saved
        self.stats = OffloadStats(
            saved_bytes=self._saved,
            offloaded_bytes=self._offloaded,
            offloaded_tensors=len(self._records),
            kept_tensors=self._kept,
        )

    # -- hooks -------------------------------------------------------------

    def _candidate(self, tensor: torch.Tensor) -> bool:
        if not tensor.is_floating_point() or tensor.layout is not torch.strided:
            return False
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        base = tensor._base if tensor._base is not None else tensor
        return not (base.is_leaf and base.requires_grad)

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        self._saved += nbytes
        if self.offload_ratio > 0 and self._candidate(tensor):
            after = self._offloaded + nbytes
            fits = (
                after <= self._budget
                if self._budget is not None
                else after <= self.offload_ratio * self._saved
            )
            if fits:
                self._offloaded = after
                engine = self.engine if self.engine is not None else _default_engine()
                record = _Offloaded(engine, tensor, len(self._records))
                self._records.append(weakref.ref(record))
                return record
        self._kept += 1
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            tensor: torch.Tensor = packed
            return tensor
        records = self._records
        for ahead in range(packed.index - 1, max(-1, packed.index - 1 - self.prefetch), -1):
            record = records[ahead]() if ahead < len(records) else None
            if record is not None:
                record.prefetch()
        return packed.take()
