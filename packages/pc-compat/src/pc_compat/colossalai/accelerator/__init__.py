"""``colossalai.accelerator``: ``get_accelerator`` and the accelerators."""

from __future__ import annotations

from pc_compat.colossalai.accelerator._accelerator import (
    BaseAccelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
)

__all__ = ["BaseAccelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator"]
