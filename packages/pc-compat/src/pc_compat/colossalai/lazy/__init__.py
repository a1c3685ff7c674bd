"""``colossalai.lazy``: ``LazyInitContext`` (pc-chunk's)."""

from __future__ import annotations

from typing import Any

import torch

from pc_chunk import LazyInitContext as _PcLazyInitContext

__all__ = ["LazyInitContext"]


class LazyInitContext(_PcLazyInitContext):  # type: ignore[no-untyped-call]
    """Colossal-AI's ``LazyInitContext(tensor_cls=LazyTensor,
    default_device=None)``. Tensors are recorded, not allocated, and
    ``boost`` materialises each rank's share on the plugin's device with the
    values eager construction gives; where they are materialised is the
    plugin's business, so ``default_device`` (where Colossal-AI's lazy
    tensors would be made) has no effect and is accepted for any device.
    ``tensor_cls`` other than the default is refused: pc has one lazy
    tensor kind."""

    def __init__(
        self,
        tensor_cls: Any = None,
        default_device: str | torch.device | int | None = None,
    ) -> None:
        if tensor_cls is not None and getattr(tensor_cls, "__name__", "") != "LazyTensor":
            raise TypeError(
                f"LazyInitContext(tensor_cls={tensor_cls!r}): pc has one lazy tensor kind; "
                "leave tensor_cls at its default."
            )
        if default_device is not None:
            torch.device(default_device)  # a device that does not parse is refused here
        super().__init__()
        # Where the original would place lazy tensors; kept for inspection only.
        self.default_device = default_device
