"""``colossalai.accelerator``."""

from __future__ import annotations

from pc_comm import get_accelerator

__all__ = ["get_accelerator"]
