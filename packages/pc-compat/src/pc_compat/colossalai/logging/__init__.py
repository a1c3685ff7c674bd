"""``colossalai.logging``: a distributed logger, under Colossal-AI's
default name."""

from __future__ import annotations

from collections.abc import Sequence

from pc_compat.colossalai.logging._logger import DistributedLogger
from pc_compat.colossalai.logging._logger import disable_existing_loggers as _disable
from pc_compat.colossalai.logging._logger import get_dist_logger as _get

__all__ = ["DistributedLogger", "disable_existing_loggers", "get_dist_logger"]


def get_dist_logger(name: str = "colossalai") -> DistributedLogger:
    return _get(name)


def disable_existing_loggers(
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = ["colossalai"],
) -> None:
    _disable(include, tuple(exclude))
