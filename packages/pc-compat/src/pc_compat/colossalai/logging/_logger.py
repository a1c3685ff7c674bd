"""A logger that knows its rank: Colossal-AI's ``get_dist_logger`` shape.

``get_dist_logger().info("step 3", ranks=[0])`` logs on rank 0 only;
``log_to_file(dir)`` adds ``dir/rank_<rank>.log``. Built on the standard
library's :mod:`logging`: the state (handlers, levels) lives in the named
``logging.Logger``, so two calls of ``get_dist_logger(name)`` give views of
the same logger and there is no registry of our own.

[Note: levels of the console and of files]
``set_level`` sets what the console shows; ``log_to_file(level=...)`` what
that file receives. The underlying logger's threshold is the lowest of them,
so a file opened at DEBUG gets DEBUG records while the console stays at
INFO. (Colossal-AI gates every handler by the logger's level, so there a
file's DEBUG level is silently ignored under the default INFO logger.)
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

__all__ = [
    "DEFAULT_LOGGER_NAME",
    "DistributedLogger",
    "disable_existing_loggers",
    "get_dist_logger",
]

DEFAULT_LOGGER_NAME = "pc"
_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
}
_FORMAT = "pc - %(name)s - %(levelname)s: %(pathname)s:%(lineno)d %(funcName)s: %(message)s"


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (so a
    redirected stderr, a test's capture or a spawned rank's log, sees it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


def _parse_level(level: str) -> int:
    if not isinstance(level, str) or level.upper() not in _LEVELS:
        raise ValueError(f"level must be one of {sorted(_LEVELS)}, got {level!r}.")
    return _LEVELS[level.upper()]


def _current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DistributedLogger:
    """A view of ``logging.getLogger(name)`` whose calls take ``ranks``.

    Records go to stderr as ``pc - <name> - <LEVEL>: <file>:<line> <function>:
    <message>`` (one line; Colossal-AI logs the caller's location as a second
    record). The logger does not propagate to the root logger, so a script
    that also configures ``logging.basicConfig`` does not print each line
    twice.
    """

    def __init__(self, name: str = DEFAULT_LOGGER_NAME) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}.")
        # The stdlib logger holds all state; this object only adds ranks.
        self._logger = logging.getLogger(name)
        if not any(isinstance(h, _ConsoleHandler) for h in self._logger.handlers):
            console = _ConsoleHandler()
            console.setLevel(logging.INFO)
            console.setFormatter(logging.Formatter(_FORMAT))
            self._logger.addHandler(console)
            self._logger.propagate = False
            self._sync_threshold()

    @classmethod
    def get_instance(cls, name: str) -> DistributedLogger:
        """The logger called ``name`` (Colossal-AI's spelling of
        :func:`get_dist_logger`)."""
        return cls(name)

    @property
    def name(self) -> str:
        return self._logger.name

    @property
    def rank(self) -> int:
        """This process's rank in the default group; 0 before one exists."""
        return _current_rank()

    def _console(self) -> _ConsoleHandler:
        return next(h for h in self._logger.handlers if isinstance(h, _ConsoleHandler))

    def _sync_threshold(self) -> None:
        # [Note: levels of the console and of files]
        levels = [h.level for h in self._logger.handlers if h.level != logging.NOTSET]
        self._logger.setLevel(min(levels, default=logging.INFO))

    def set_level(self, level: str) -> None:
        """What the console shows: ``"DEBUG"``, ``"INFO"``, ``"WARNING"`` or
        ``"ERROR"``. Files keep the level they were opened with."""
        self._console().setLevel(_parse_level(level))
        self._sync_threshold()

    def log_to_file(
        self,
        path: str | os.PathLike[str],
        mode: str = "a",
        level: str = "INFO",
        suffix: str | None = None,
    ) -> Path:
        """Also write records of ``level`` and above to
        ``path/rank_<rank>.log`` (``rank_<rank>_<suffix>.log`` with a suffix).
        ``path`` is a directory, created if missing, as in Colossal-AI.
        Returns the file's path."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"path must be a str or os.PathLike (a directory), got {type(path).__name__}."
            )
        if mode not in ("a", "w"):
            raise ValueError(f"mode must be 'a' (append) or 'w' (truncate), got {mode!r}.")
        file_level = _parse_level(level)
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise ValueError(
                f"log_to_file takes a directory and writes rank_<rank>.log into it; "
                f"{str(directory)!r} is a file. Pass its parent directory."
            )
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"rank_{self.rank}" if suffix is None else f"rank_{self.rank}_{suffix}"
        target = directory / f"{stem}.log"
        handler = logging.FileHandler(target, mode)
        handler.setLevel(file_level)
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._logger.addHandler(handler)
        self._sync_threshold()
        return target

    def _log(self, level: int, message: object, ranks: Sequence[int] | None) -> None:
        if ranks is not None:
            if isinstance(ranks, (int, str)) or not all(isinstance(r, int) for r in ranks):
                raise TypeError(f"ranks must be a list of ranks such as [0], got {ranks!r}.")
            if self.rank not in ranks:
                return
        # stacklevel 3: the record names the caller of info()/warning()/...
        self._logger.log(level, message, stacklevel=3)

    def debug(self, message: object, ranks: Sequence[int] | None = None) -> None:
        """Log at DEBUG, on every rank or only on those in ``ranks``."""
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: object, ranks: Sequence[int] | None = None) -> None:
        """Log at INFO, on every rank or only on those in ``ranks``."""
        self._log(logging.INFO, message, ranks)

    def warning(self, message: object, ranks: Sequence[int] | None = None) -> None:
        """Log at WARNING, on every rank or only on those in ``ranks``."""
        self._log(logging.WARNING, message, ranks)

    def error(self, message: object, ranks: Sequence[int] | None = None) -> None:
        """Log at ERROR, on every rank or only on those in ``ranks``."""
        self._log(logging.ERROR, message, ranks)


def get_dist_logger(name: str = DEFAULT_LOGGER_NAME) -> DistributedLogger:
    """The distributed logger called ``name`` (Colossal-AI's
    ``colossalai.logging.get_dist_logger``)."""
    return DistributedLogger(name)


def disable_existing_loggers(
    include: Sequence[str] | None = None, exclude: Sequence[str] = (DEFAULT_LOGGER_NAME,)
) -> None:
    """Raise the level of existing loggers to WARNING: those in ``include``,
    or, without it, all but those in ``exclude``."""
    names = list(logging.Logger.manager.loggerDict)
    chosen = (
        [n for n in names if n in include]
        if include is not None
        else [n for n in names if n not in exclude]
    )
    for name in chosen:
        logging.getLogger(name).setLevel(logging.WARNING)
