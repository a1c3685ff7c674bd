"""Disk errors named: a checkpoint write that fails says, in one line,
which file, which operation, and why.

[Note: disk errors named]
``torch.save`` writes through a C++ stream that drops the errno: a full
disk reaches the caller as ``RuntimeError: basic_ios::clear: iostream
error`` (full when the file was opened) or ``[enforce fail at
inline_container.cc:...] unexpected pos`` (it filled during the write),
and DCP's writers wrap either in exceptions of their own. A Python write
says ``[Errno 28] No space left on device`` without the file's name.
:func:`named_disk_errors` turns an OSError, or torch's stream error,
raised inside it into a :class:`DiskWriteError`: an OSError with the errno
of the cause, whose message names the path, the operation and the cause
(a full disk with the bytes free there, ``shutil.disk_usage``, and the
bytes the write needs where the caller knows them; permission denied; a
read-only file system). A stream error carries no errno, so its cause is
read from the file system: read-only (``statvfs``), not writable
(``os.access``), or out of space (less free than the write needs, or
than 1 % of the disk and 256 MiB when that is not known); else it is an
I/O error with torch's words. What the failed write left behind is for
the caller to remove (``atomic_write`` removes its temporary file, a
sharded save each rank's files).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DiskWriteError",
    "disk_write_error",
    "errno_error",
    "error_chain",
    "named_disk_errors",
]

# What torch's writers say when a write came out short (no errno).
_STREAM_ERRORS = (
    "basic_ios::clear",
    "iostream error",
    "unexpected pos",
    "file write failed",
    "PytorchStreamWriter failed",
    "open file failed",
)
# The strerror torch's writers quote when they have one.
_STRERRORS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
    "Permission denied": errno.EACCES,
}
_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} bytes"


class DiskWriteError(OSError):
    """A write that failed, named: ``str()`` is one line with the path, the
    operation and the cause; ``errno`` is the cause's (``ENOSPC`` for a
    full disk, ``EROFS``, ``EACCES``, ``EIO`` when unknown), ``filename``
    the path; ``free`` / ``total`` the bytes of its file system and
    ``needed`` what the write needs, where known."""

    def __init__(
        self,
        code: int,
        message: str,
        path: str,
        operation: str,
        free: int | None = None,
        total: int | None = None,
        needed: int | None = None,
    ) -> None:
        super().__init__(code, message)
        self.message = message
        self.filename = path
        self.operation = operation
        self.free, self.total, self.needed = free, total, needed

    def __str__(self) -> str:
        return self.message

    @property
    def full(self) -> bool:
        """The disk (or the user's quota) is full."""
        return self.errno in _FULL

    @property
    def user_fixable(self) -> bool:
        """A cause the user removes (space, permissions, a read-only mount):
        running again as it is fails again."""
        return self.errno in _FULL or self.errno in _NOT_WRITABLE

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # crosses ranks in DCP's gathers
        return (
            type(self),
            (self.errno, self.message, self.filename, self.operation, self.free, self.total,
             self.needed),
        )  # fmt: skip


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``, else ``__context__``),
    each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def errno_error(error: BaseException) -> OSError | None:
    """The OSError with an errno behind ``error`` (itself or a cause)."""
    found = (e for e in error_chain(error) if isinstance(e, OSError) and e.errno is not None)
    return next(found, None)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (what the file system is asked)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _stream_cause(folder: Path, needed: int | None) -> int:
    """The errno behind a short write of torch's, read from the file system."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return errno.EROFS
        if not os.access(folder, os.W_OK):
            return errno.EACCES
        usage = shutil.disk_usage(folder)
    except OSError:
        return errno.EIO
    floor = max(256 * 2**20, usage.total // 100)
    if usage.free < floor or (needed is not None and usage.free < needed):
        return errno.ENOSPC
    return errno.EIO


def disk_write_error(
    error: BaseException, path: str | os.PathLike[str], operation: str, needed: int | None = None
) -> DiskWriteError | None:
    """``error``, raised by ``operation`` writing ``path``, as a
    :class:`DiskWriteError` [Note: disk errors named]; None when it is not
    a failed write (an OSError, or torch's stream error)."""
    if isinstance(error, DiskWriteError):
        return error
    target = Path(path)
    cause = errno_error(error)
    text = " ".join(str(error).split())
    if cause is None and not any(words in text for words in _STREAM_ERRORS):
        return None
    folder = _existing(target if target.is_dir() else target.parent)
    code = cause.errno if cause is not None and cause.errno is not None else None
    if code is None:
        quoted = [number for words, number in _STRERRORS.items() if words in text]
        code = quoted[0] if quoted else _stream_cause(folder, needed)
    free = total = None
    try:
        usage = shutil.disk_usage(folder)
        free, total = usage.free, usage.total
    except OSError:
        pass
    if code in _FULL:
        room = f"{_size(free)} free of {_size(total)}" if free is not None and total else (
            "free space unknown"
        )  # fmt: skip
        need = f"; it needs {_size(needed)}" if needed is not None else ""
        reason = f"the disk is full ({room} there{need})"
    elif code == errno.EROFS:
        reason = "read-only file system"
    elif code in (errno.EACCES, errno.EPERM):
        reason = "permission denied"
    else:
        words = cause.strerror if cause is not None and cause.strerror else "the write failed"
        reason = f"{words} ({type(error).__name__}: {text[:300]})"
    doing = f" ({operation})" if operation else ""
    message = f"cannot write {target}{doing}: {reason}"
    return DiskWriteError(code, message, str(target), operation, free, total, needed)


class _Named(AbstractContextManager[None]):
    """:func:`named_disk_errors`: a class, not a generator, so that no frame
    of its own keeps the failed write's traceback (:func:`_drop_frames`)."""

    def __init__(self, path: str | os.PathLike[str], operation: str, needed: int | None) -> None:
        self.path, self.operation, self.needed = path, operation, needed

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: Any
    ) -> Literal[False]:
        del trace  # this frame lives on in the named error's traceback
        if not isinstance(error, Exception) or isinstance(error, DiskWriteError):
            return False
        named = disk_write_error(error, self.path, self.operation, self.needed)
        if named is None:
            return False
        _drop_frames(error)
        raise named from error


def named_disk_errors(
    path: str | os.PathLike[str], operation: str, needed: int | None = None
) -> AbstractContextManager[None]:
    """Raise what fails writing ``path`` inside it as a :class:`DiskWriteError`
    naming ``path``, ``operation`` (``"rank 0's RNG state"``; "" when the
    path says enough) and the cause, with the ``needed`` bytes where known
    [Note: disk errors named]; other exceptions pass unchanged."""
    return _Named(path, operation, needed)


def _drop_frames(error: BaseException) -> None:
    """Let go of the failed writer's frames: they hold its open file, and
    with it the space the write took, for as long as the error lives (a
    caller that catches it and goes on). Its words are in the message."""
    for link in error_chain(error):
        link.__traceback__ = None
