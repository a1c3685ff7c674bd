"""``colossalai.cluster``."""

from __future__ import annotations

from pc_comm import DistCoordinator

__all__ = ["DistCoordinator"]
