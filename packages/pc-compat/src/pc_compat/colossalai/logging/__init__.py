"""``colossalai.logging``."""

from __future__ import annotations

from pc_comm import disable_existing_loggers, get_dist_logger

__all__ = ["disable_existing_loggers", "get_dist_logger"]
