"""Reading checkpoints without running code from them.

[Note: loading runs no code]
A pickle can name any importable callable and have the reader call it
(``__reduce__``), so a checkpoint file from someone else must never reach
``pickle.load`` or ``torch.load(weights_only=False)``. torch's DCP reader
does both: ``FileSystemReader.read_metadata`` unpickles ``.metadata`` and
the default load planner ``torch.load``\\s every non-tensor item with
``weights_only=False``. pc reads DCP directories only through

- :class:`SafeFileSystemReader`: ``.metadata`` through :func:`restricted_load`,
  which builds only DCP's metadata classes, torch's dtypes, layouts and
  ``Size``, paths and plain Python values, and refuses anything else,
  naming it, before any of it is called;
- :func:`safe_load_bytes` (used by pc-zero's load planner): every
  non-tensor item through ``torch.load(weights_only=True)``, torch's
  unpickler of tensors and plain values.

Every ``.pt`` file pc reads is ``torch.load``\\ed with ``weights_only=True``.
A refused file raises :class:`UnsafeCheckpointError`: nothing of it was run.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

__all__ = [
    "SafeFileSystemReader",
    "UnsafeCheckpointError",
    "legacy_loads",
    "named_dcp_failures",
    "read_metadata",
    "refuse_weights_only",
    "restricted_load",
    "safe_load_bytes",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATHS = frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"})
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,  # where Python 3.13 pickles them from
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
}


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file that names code pc will not run to read it."""


def _refusal(source: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} holds a pickled {what}, which pc does not load: unpickling it could run "
        "code. pc's checkpoints hold only tensors, DCP's metadata and plain values "
        "(numbers, strings, lists, dicts). Do not load a checkpoint of unknown origin; if "
        "you wrote this one with another tool, re-save its tensors with safetensors."
    )


class _Restricted(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):
            return torch.__dict__[name]  # no attribute lookup: nothing imported
        if module == _DCP_METADATA and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _DCP_METADATA:
                return found  # a dataclass or enum of DCP's metadata
        raise _refusal(self.source, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.source, f"persistent object {pid!r}")


def restricted_load(file: IO[bytes], source: str) -> Any:
    """Unpickle ``file`` (named ``source`` in errors), building only the
    types [Note: loading runs no code] lists."""
    return _Restricted(file, source).load()


def _storage_from_bytes(data: bytes) -> Any:
    """A tensor's storage pickled by ``pickle.dumps`` (torch's
    ``_load_from_bytes`` loads it with the full unpickler): read with the
    weights-only one."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class _LegacyBlob(_Restricted):
    """Bare pickles pc-zero wrote before its objects went through
    ``torch.save`` (an optimizer's 0-d ``step`` tensor among them): the
    restricted unpickler plus torch's tensor rebuild, its storages read by
    the weights-only unpickler."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return torch._utils._rebuild_tensor_v2
        return super().find_class(module, name)


def legacy_loads(data: bytes, source: str) -> Any:
    """A bare pickle of pc-zero's earlier object items [Note: loading runs no code]."""
    return _LegacyBlob(io.BytesIO(data), source).load()


def safe_load_bytes(value: IO[bytes], source: str) -> Any:
    """A non-tensor item of a checkpoint (written by ``torch.save``), read
    with torch's weights-only unpickler."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise refuse_weights_only(error, source) from None


def _weights_only_detail(message: str) -> str:
    """The line of torch's weights-only error that names what was refused."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error" in line or "unsupported global" in line.lower():
            return line.removeprefix("WeightsUnpickler error: ")
    return lines[0] if lines else "unknown"


def _unreadable(path: Path, error: Exception) -> ValueError:
    lines = str(error).strip().splitlines()
    return ValueError(
        f"{path} is not readable DCP metadata: it is garbled or cut short "
        f"({type(error).__name__}: {lines[0] if lines else 'no message'}). Load an earlier "
        "checkpoint, or save this one again."
    )


def refuse_weights_only(error: Exception, source: str) -> UnsafeCheckpointError:
    """``torch.load(weights_only=True)``'s refusal of ``source`` (a pickle
    naming code) as an :class:`UnsafeCheckpointError` naming the file and
    what it names, in one line."""
    return UnsafeCheckpointError(
        f"{source} holds a pickled object pc does not load (unpickling it could run "
        f"code): {_weights_only_detail(str(error)).rstrip('.')}. Do not load a checkpoint of "
        "unknown origin."
    )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` through
    :func:`restricted_load` [Note: loading runs no code]."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = Path(str(self.path)) / name
        with open(path, "rb") as file:
            try:
                metadata = restricted_load(file, f"checkpoint metadata {path}")
            except UnsafeCheckpointError:
                raise
            except Exception as error:  # garbled or cut short: pickle's own words, named
                raise _unreadable(path, error) from None
        if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
            raise UnsafeCheckpointError(
                f"{path} is not DCP metadata (it holds a {type(metadata).__name__})."
            )
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            relative = str(getattr(info, "relative_path", ""))
            if not relative or "/" in relative or "\\" in relative or relative in (".", ".."):
                raise UnsafeCheckpointError(
                    f"{path} names the data file {relative!r}, outside its directory: a "
                    "checkpoint's files are read from its own directory only."
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | Path) -> Any:
    """The DCP metadata of checkpoint directory ``path``, read safely."""
    return SafeFileSystemReader(str(path)).read_metadata()


@contextmanager
def named_dcp_failures(what: str) -> Iterator[None]:
    """DCP reports a rank's failure as a CheckpointException, a
    BaseException that ``except Exception`` misses: raise it as the error
    it wraps, naming the rank (an OSError stays one: a full disk; a refused
    pickle stays an :class:`UnsafeCheckpointError`; anything else is a
    ValueError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        rank, failure = next(iter(error.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        lines = str(inner).strip().splitlines()
        message = f"{what}: rank {rank}: {type(inner).__name__}: {lines[0] if lines else ''}"
        if isinstance(inner, OSError):
            raise OSError(inner.errno, message) from None
        if isinstance(inner, UnsafeCheckpointError):
            raise UnsafeCheckpointError(message) from None
        raise ValueError(message) from None
