"""Where pc may write, rename and remove: inside the directory the user
named, never through a link [Note: paths pc touches].

[Note: paths pc touches]
A checkpoint or export directory may hold what someone else put there: an
old ``model.safetensors.index.json`` naming ``../x`` or ``/etc/passwd``, a
``step-N.partial`` that is a symlink to another directory, a shard name
linked to a file elsewhere. Every path pc writes, renames or removes goes
through this module, which holds three rules:

- a name read from a file (an index's file names) is removed only when it
  is a plain file name in that directory: no separator, no ``..``, not
  absolute; anything else is left alone and named in a warning
  (:class:`OutsidePathWarning`);
- a link where pc writes one of its own files, or where it keeps a
  directory it rebuilds (``step-N.partial``, ``.pc-export``), is removed
  (the link itself, never what it points to) before pc writes, so nothing
  is written through it; files are created with ``O_EXCL | O_NOFOLLOW``;
- a link where pc keeps a directory it does not rebuild (``checkpoints/``
  under ``--output-dir``) is refused with :class:`UnsafePathError`, naming
  it and the fix.

Removing a tree uses :func:`shutil.rmtree`, which on Linux walks by file
descriptors and removes a link inside the tree as a link; a link at the
top is unlinked here instead of raising (or, with ``ignore_errors``, being
silently kept). The directory the user named may itself be a link: that
is the user's choice, and pc works inside wherever it points.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "DCP_FILES",
    "OutsidePathWarning",
    "UnsafePathError",
    "clear_links",
    "create_file",
    "own_directory",
    "plain_name",
    "refuse_link",
    "remove_named",
    "remove_tree",
]


class UnsafePathError(ValueError):
    """A path where pc keeps its own files is a link (or not a directory)."""


class OutsidePathWarning(UserWarning):
    """A name pc was asked to remove lies outside its directory: left alone."""


def plain_name(name: str) -> bool:
    """``name`` names a file directly in a directory: not empty, no
    separator, not ``.`` or ``..``, no NUL."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and os.sep not in name
    )


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def remove_named(directory: Path, names: Iterable[str], why: str, suffix: str = "") -> list[str]:
    """Remove ``directory``'s files ``names`` (read from a file: ``why``
    says which), each only when it is a plain name of a file or link in
    ``directory`` ending in ``suffix``; a link is removed, never its
    target. The others are left alone and named in one
    :class:`OutsidePathWarning`. Returns the names left alone."""
    refused: list[str] = []
    for name in sorted(set(names)):
        if not isinstance(name, str) or not plain_name(name) or not name.endswith(suffix):
            refused.append(repr(name))
            continue
        path = directory / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):  # pc removes files by name, never directories
            refused.append(repr(name))
            continue
        path.unlink(missing_ok=True)
    if refused:
        warnings.warn(
            f"{directory}: {why} names {', '.join(refused)}, which lie outside {directory} "
            f"(or are not {suffix or 'files'} files in it); pc removes only those in the "
            "directory it writes, so these were left alone.",
            OutsidePathWarning,
            stacklevel=2,
        )
    return refused


def remove_tree(path: Path) -> None:
    """Remove ``path``: a directory and what it holds (links inside removed
    as links), or a file, or a link (the link only). Nothing when absent."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def refuse_link(path: Path, fix: str = "") -> None:
    """Raise :class:`UnsafePathError` when ``path`` is a link: pc keeps a
    directory of its own there and does not write through links."""
    if _is_link(path):
        raise UnsafePathError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where pc keeps a directory "
            f"of its own: pc does not write through links. {fix or 'Remove the link.'}"
        )


def own_directory(path: Path, *, replace: bool, fix: str = "") -> Path:
    """Make sure ``path`` is a real directory pc may write into, creating it
    (0700, with missing parents) when absent. A link there is removed when
    ``replace`` (pc rebuilds this directory), else refused with
    :class:`UnsafePathError` naming it (and ``fix``); so is a file."""
    if _is_link(path):
        if not replace:
            refuse_link(path, fix)
        path.unlink()
    if path.exists() and not path.is_dir():
        raise UnsafePathError(
            f"{path} is a file, where pc keeps a directory of its own: move it away."
        )
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another rank made it meanwhile
            continue
    return path


def create_file(path: Path) -> None:
    """Create ``path`` empty (0666 less the umask) for a writer that opens it by name: a
    link or file already there is removed first, and the file is made
    with ``O_EXCL | O_NOFOLLOW``, so the write cannot go through a link."""
    if _is_link(path) or path.is_file():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    os.close(os.open(path, flags, 0o666))  # the umask decides, as for any file a tool writes


# What a sharded (DCP) save writes by name in its directory: each rank's
# shard files, the metadata (and per-rank metadata) with their temporaries,
# pc's checksum sidecar and its temporary.
DCP_FILES = re.compile(
    r"__\d+_\d+\.distcp|(?:__\d+)?\.metadata(?:\.tmp)?|\.checksums\.json(?:\.tmp-\d+)?"
)


def clear_links(directory: Path, pattern: re.Pattern[str] = DCP_FILES) -> list[str]:
    """Remove the links among ``directory``'s entries whose names pc writes
    (``pattern``: by default a sharded save's), before a writer that opens
    them by name follows them. Returns the names removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if pattern.fullmatch(entry.name) and entry.is_symlink():
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed
