"""How pc-train fails: the exit codes, the one line each failed rank
leaves for the launcher to print (:func:`note`, :func:`leave`,
:func:`fail`), and the classification of the exception that ended a rank
into a code and a message with the fix (:func:`describe_failure`)."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

from pc_booster.checkpoint import DiskWriteError
from pc_booster.checkpoint.disk import errno_error, error_chain
from pc_train import memory_limits
from pc_train.memory_limits import bytes_text
from pc_train.train_config import TrainConfig

__all__ = [
    "ERROR_DIR",
    "EXIT_FAILURE",
    "EXIT_USER_ERROR",
    "bytes_text",
    "declared_codes",
    "describe_failure",
    "fail",
    "leave",
    "note",
    "os_reason",
    "traceback_file",
]

# Where our launcher collects each failed rank's line (rank<N>.txt), to
# print each once; unset under torchrun, where the ranks print their own.
ERROR_DIR = "PC_TRAIN_ERROR_DIR"

# [Note: exit codes]
# 0: done. 1: a failure (a crash, a rank that died or stalled): the same
# command may succeed when run again, with --resume. 2: an error the user
# fixes before running again (bad settings or input, a full disk, a
# read-only or unwritable directory, a bad checkpoint, memory exhausted, a
# run that diverged): running it again as it is fails again, so a
# scheduler that restarts on failure should stop on 2. 130: interrupted
# (SIGINT / SIGTERM), a checkpoint saved. Each failed rank exits with its
# own code; the launcher exits 2 when any rank did, else 1.
EXIT_FAILURE = 1
EXIT_USER_ERROR = 2

# Raised by pc-train's own checks, with a message that says the fix.
_USER_ERRORS = (ValueError, TypeError, FileNotFoundError, MemoryError)


def os_reason(error: OSError) -> str:
    """Why a write failed, in a few words (a full disk, read-only ...)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno == errno.EROFS:
        return "read-only file system"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return error.strerror or type(error).__name__


def leave(message: str, code: int) -> None:
    """Leave ``message`` for the launcher (:func:`note`) and exit with
    ``code`` at once."""
    note(message, overwrite=code != 143)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: destroying a group with a dead peer can abort


def _write_whole(path: Path, text: str) -> None:
    """Whole or not at all: the launcher may read while a stopped rank writes."""
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def declared_codes(folder: Path) -> set[int]:
    """The exit codes the ranks that failed with a line (:func:`fail`)
    declared in the launcher's error directory ``folder``. The launcher
    counts them with those torch's launcher saw: a rank that fails on its
    own error (out of memory, a full disk: code 2) is still tearing down
    when a peer, seeing its connection close, leaves with code 1 at once,
    and torch's launcher records only the first exit it polls, then stops
    the rest [Note: exit codes]."""
    codes: set[int] = set()
    for path in folder.glob("rank*.code"):
        try:
            codes.add(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return codes


def note(message: str, overwrite: bool = False) -> None:
    """A line for our launcher to print once after a failure; under
    torchrun, printed by the rank."""
    rank = os.environ.get("RANK", "0")
    folder = os.environ.get(ERROR_DIR)
    if not folder:
        print(f"pc-train (rank {rank}): {message}", file=sys.stderr, flush=True)
        return
    path = Path(folder, f"rank{rank}.txt")
    if overwrite or not path.exists():
        _write_whole(path, message)


def _named_write(error: BaseException) -> DiskWriteError | None:
    """The named failed write behind ``error`` (itself, or along its causes)."""
    return next((e for e in error_chain(error) if isinstance(e, DiskWriteError)), None)


def _disk_full(error: BaseException, out: Path) -> bool:
    """Whether ``error`` is a write that failed on a full disk. torch.save
    and DCP's writers say so in their own words, or only that a write came
    out short; a short write counts when the disk of ``out`` is (nearly) full."""
    text = str(error).lower()
    if "no space left" in text or "disk quota" in text:
        return True
    if "file write failed" not in text and "unexpected pos" not in text:
        return False
    try:
        usage = shutil.disk_usage(out)
    except OSError:
        return False
    return usage.free < max(256 * 2**20, usage.total // 100)


def describe_failure(error: BaseException, config: TrainConfig) -> tuple[int, str]:
    """(exit code, one line) for an exception that ended a rank: what it
    was, and the fix where the user has one."""
    kind = type(error).__name__
    text = " ".join(str(error).split()) or "(no message)"
    out = Path(config.output_dir)
    named = _named_write(error)
    if named is not None:  # [Note: disk errors named in pc_booster.checkpoint.disk]
        fix = (
            "free space there or pass --output-dir on a larger disk"
            if named.full
            else "pass a writable --output-dir"
            if named.user_fixable
            else "check the disk"
        )
        line = " ".join(str(named).split())
        code = EXIT_USER_ERROR if named.user_fixable else EXIT_FAILURE
        return code, f"{type(named).__name__}: {line}; {fix}, then --resume."
    cause = errno_error(error)
    full = cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    if full or (cause is None and _disk_full(error, out)):
        where = Path(cause.filename) if cause is not None and cause.filename else out
        try:
            usage = shutil.disk_usage(where if where.exists() else out)
            room = f"{bytes_text(usage.free)} free of {bytes_text(usage.total)}"
        except OSError:
            room = "free space unknown"
        return EXIT_USER_ERROR, (
            f"{kind}: the disk is full writing {where} ({room}): {text}; free space there or "
            "pass --output-dir on a larger disk, then --resume."
        )
    if cause is not None and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where = cause.filename or out
        return EXIT_USER_ERROR, (
            f"{kind}: cannot write {where}: {os_reason(cause)} ({text}); pass a writable "
            "--output-dir."
        )
    if memory_limits.is_allocation_failure(error):  # [Note: out of memory, named]
        limit = memory_limits.address_space_limit()
        cap = (
            f"the address-space limit (ulimit -v, RLIMIT_AS) of {bytes_text(limit)}"
            if limit is not None
            else "the memory this process may use"
        )
        return EXIT_USER_ERROR, (
            f"out of memory: an allocation failed at {cap} ({kind}: {text}); raise the limit, "
            "or lower the memory each rank needs (pc-estimate --search shows each layout's)."
        )
    if isinstance(error, _USER_ERRORS):
        return EXIT_USER_ERROR, f"{kind}: {text}"
    return EXIT_FAILURE, f"{kind}: {text}"


def traceback_file(config: TrainConfig, rank: int, error: BaseException) -> Path | None:
    """The traceback, for a bug report: in ``<output-dir>/logs``, else the
    temporary directory (a full or read-only disk); None if neither takes it."""
    text = "".join(traceback.format_exception(error))
    name = f"rank{rank}-error.log"
    for folder in (Path(config.output_dir) / "logs", Path(tempfile.gettempdir())):
        path = folder / name if folder.name == "logs" else folder / f"pc-train-{os.getpid()}-{name}"
        try:
            if folder.name == "logs":
                from pc_train.checkpoint import private_dir

                private_dir(folder)
            handle = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(handle, "w") as file:  # readable by this user only
                file.write(text)
        except OSError:
            continue
        return path
    return None


def fail(message: str, code: int = EXIT_USER_ERROR) -> NoReturn:
    """Report an error once, without a traceback, and exit with ``code``."""
    folder = os.environ.get(ERROR_DIR)
    if folder:  # our own launcher prints it once
        path = Path(folder, f"rank{os.environ.get('RANK', '0')}.txt")
        _write_whole(path.with_suffix(".code"), str(code))  # first: see declared_codes
        _write_whole(path, f"error: {message}")
    else:
        print(f"pc-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
