"""``colossalai.utils``: ``get_current_device`` and ``set_seed``."""

from __future__ import annotations

import random

import torch

from pc_compat.colossalai.accelerator import get_accelerator

__all__ = ["get_current_device", "set_seed"]


def get_current_device() -> torch.device:
    """This rank's device (the accelerator's current one, else the CPU)."""
    return get_accelerator().get_current_device()


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)
