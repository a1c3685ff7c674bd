"""Between sharded checkpoints and ``transformers`` directories, in bounded
memory [Note: streamed export].

[Note: streamed export]
A sharded checkpoint (``Booster.save_model(..., shard=True)``: DCP, keys
``model/<name>``) becomes a directory ``from_pretrained`` reads
(``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json``)
without any process holding the model: the output files are planned from
the checkpoint's metadata alone (names, shapes, dtypes; at most
``size_per_shard`` MiB each, a tensor larger than that alone in its file),
each file's header is written first, then each tensor is read from the
checkpoint (only its byte ranges), appended and dropped. A process holds one
tensor at a time, so the peak is the largest tensor plus a constant,
whatever ``size_per_shard`` is. Files are split among the ranks that call
it (rank ``r`` of ``n`` writes files ``r, r + n, ...``); the index is
written last, by whoever writes it (:func:`write_index`), as the commit
point. The reverse, :func:`import_pretrained`, writes a ``transformers``
directory as a sharded checkpoint, reading one tensor at a time too.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pc_booster.checkpoint.checksum import crc_hex, metadata_entry
from pc_booster.checkpoint.disk import named_disk_errors
from pc_booster.checkpoint.paths import clear_links, create_file, remove_named
from pc_zero import Pieces, PiecesLoadPlanner, PiecesSavePlanner

__all__ = [
    "INDEX",
    "ExportPlan",
    "atomic_write",
    "export_files",
    "import_pretrained",
    "indexed_files",
    "plan_export",
    "pretrained_reader",
    "remove_files",
    "remove_orphans",
    "shard_names",
    "write_index",
]

INDEX = "model.safetensors.index.json"
_PREFIX = "model/"
# safetensors' dtype names.
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class ExportPlan:
    """The output files, each a list of ``(name, shape, dtype)``."""

    files: tuple[tuple[tuple[str, torch.Size, torch.dtype], ...], ...]

    def total_bytes(self) -> int:
        return sum(
            math.prod(shape) * dtype.itemsize
            for entries in self.files
            for _, shape, dtype in entries
        )


def _model_tensors(checkpoint: Path) -> list[tuple[str, torch.Size, torch.dtype]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pc_zero import read_metadata

    if not (checkpoint / ".metadata").exists():
        raise ValueError(
            f"{checkpoint} is not a sharded checkpoint (no .metadata): pass a directory "
            "written by Booster.save_model(..., shard=True) or pc-train."
        )
    metadata = read_metadata(checkpoint).state_dict_metadata
    out = [
        (key.removeprefix(_PREFIX), md.size, md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith(_PREFIX) and isinstance(md, TensorStorageMetadata)
    ]
    if not out:
        raise ValueError(f"{checkpoint} holds no model tensors (keys model/...).")
    return out


def plan_export(checkpoint: str | os.PathLike[str], size_per_shard: int = 1024) -> ExportPlan:
    """The output files of ``checkpoint``'s model, in the checkpoint's key
    order, each at most ``size_per_shard`` MiB (a larger tensor alone)."""
    if size_per_shard <= 0:
        raise ValueError(f"size_per_shard must be positive MiB, got {size_per_shard}.")
    limit = size_per_shard * 2**20
    files: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    used = 0
    for name, shape, dtype in _model_tensors(Path(checkpoint)):
        size = math.prod(shape) * dtype.itemsize
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append((name, shape, dtype))
        used += size
    return ExportPlan(tuple(tuple(f) for f in files))


def _header(
    entries: Sequence[tuple[str, torch.Size, torch.dtype]], sums: dict[str, str] | None = None
) -> bytes:
    """The header of a safetensors file of ``entries``, with each tensor's
    checksum (``pc_booster.checkpoint.checksum``; zeros until known: the header has the
    same length either way, so it is rewritten in place once the data is)."""
    crcs = {name: (sums or {}).get(name, "0" * 8) for name, _, _ in entries}
    table: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata_entry(crcs)}}
    offset = 0
    for name, shape, dtype in entries:
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype {dtype}.")
        size = math.prod(shape) * dtype.itemsize
        table[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _reader(checkpoint: Path) -> Any:
    """A DCP reader of ``checkpoint`` that parses its metadata once, however
    many tensors are read through it one by one."""
    from pc_zero import SafeFileSystemReader

    class Reader(SafeFileSystemReader):
        metadata: Any = None

        def read_metadata(self) -> Any:
            if self.metadata is None:
                self.metadata = super().read_metadata()
            return self.metadata

    return Reader(str(checkpoint))


def _read_tensor(reader: Any, name: str, shape: torch.Size, dtype: torch.dtype) -> Any:
    from torch.distributed.checkpoint.state_dict_loader import load

    tensor = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        load(
            {_PREFIX + name: tensor},
            storage_reader=reader,
            planner=PiecesLoadPlanner(flatten_state_dict=False),
            no_dist=True,
        )
    return tensor


def atomic_write(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: ``path`` is the old
    file or the new one, whole, whenever the writer is killed; ``tmp`` is
    made afresh (never written through a link planted there), and removed
    when the write fails. The rename replaces a link at ``path`` itself
    [Note: paths pc touches in ``pc_booster.checkpoint.paths``]."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with named_disk_errors(path, ""):  # [Note: disk errors named in .disk]
        create_file(tmp)
    try:
        with named_disk_errors(path, ""):
            write(tmp)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_files(directory: Path, names: set[str]) -> None:
    """Remove ``directory``'s files ``names`` (an old index's): only plain
    names of ``.safetensors`` files in ``directory`` (an index naming the
    index itself, ``.metadata`` or ``config.json`` cannot make pc delete
    what it just wrote); any other is left alone and named
    [Note: paths pc touches in ``pc_booster.checkpoint.paths``]."""
    remove_named(directory, names, f"the index {INDEX} it replaces", suffix=".safetensors")


def indexed_files(directory: Path) -> set[str]:
    """The files the index in ``directory`` names (none without one)."""
    try:
        return set(json.loads((directory / INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return set()


_SHARD = re.compile(r"model-(?:[0-9a-f]{8}-)?\d{5}-of-\d{5}\.safetensors")
_TEMPORARY = re.compile(
    r"\.(?:model.*\.safetensors|model\.safetensors\.index\.json|config\.json)\.tmp-\d+"
)


def remove_orphans(directory: Path) -> list[str]:
    """Remove what an export killed midway left in ``directory``: shard
    files in transformers' pattern that its index does not name, and the
    temporary files of unfinished writes. The index's own files, and
    everything else, stay. Returns the names removed."""
    if not directory.is_dir():
        return []
    named = indexed_files(directory)
    gone = [
        path.name
        for path in directory.iterdir()
        if path.is_file()
        and (
            (_SHARD.fullmatch(path.name) is not None and path.name not in named)
            or _TEMPORARY.fullmatch(path.name) is not None
        )
    ]
    remove_named(directory, set(gone), "the leftovers of an unfinished export")  # listed here
    return sorted(gone)


def shard_names(directory: Path, count: int) -> list[str]:
    """``count`` file names in transformers' pattern, fresh ones (a token in
    the name) where the plain names are taken: an export never overwrites a
    file the current index names, so killed midway it leaves that index
    whole [Note: sharded saves in ``pc_booster.checkpoint.files``]."""
    import uuid

    def names(prefix: str) -> list[str]:
        return [f"{prefix}{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]

    plain = names("model-")
    if not any((directory / name).exists() for name in plain):
        return plain
    return names(f"model-{uuid.uuid4().hex[:8]}-")


def write_file(
    checkpoint: Path, path: Path, entries: Sequence[tuple[str, torch.Size, torch.dtype]]
) -> None:
    """One safetensors file of ``entries``, read from ``checkpoint`` one
    tensor at a time."""
    reader = _reader(checkpoint)
    sums: dict[str, str] = {}
    with open(path, "wb") as stream:
        stream.write(_header(entries))
        for name, shape, dtype in entries:
            tensor = _read_tensor(reader, name, shape, dtype)
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
            sums[name] = crc_hex(data)
            stream.write(data)
            del tensor, data
        stream.seek(0)
        stream.write(_header(entries, sums))


def export_files(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    plan: ExportPlan,
    names: Sequence[str],
    rank: int = 0,
    world: int = 1,
    atomic: Any = atomic_write,
) -> None:
    """Write the files ``rank`` of ``world`` owns (``rank, rank + world,
    ...``) of ``plan`` into ``out`` under ``names``, one tensor in memory at
    a time, each through ``atomic(path, write)``."""
    source, target = Path(checkpoint), Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for index in range(rank, len(plan.files), world):
        entries = plan.files[index]
        atomic(target / names[index], lambda p, e=entries: write_file(source, p, e))


def write_index(
    out: str | os.PathLike[str],
    plan: ExportPlan,
    names: Sequence[str],
    atomic: Any = atomic_write,
    remove: Any = remove_files,
) -> None:
    """The index of ``plan``'s files (the commit point), then the removal of
    what it replaces: the files the old index named and ``model.safetensors``."""
    target = Path(out)
    old = indexed_files(target)
    weight_map = {
        name: file
        for file, entries in zip(names, plan.files, strict=True)
        for name, _, _ in entries
    }
    index = {"metadata": {"total_size": plan.total_bytes()}, "weight_map": weight_map}
    atomic(target / INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    remove(target, (old - set(names)) | {"model.safetensors"})


class _Listing:
    """A file system as DCP's storage readers use it, listing only
    ``files`` of a directory."""

    def __init__(self, fs: Any, files: set[str]) -> None:
        self.fs, self.files = fs, files

    def ls(self, path: Any) -> list[str]:
        return [str(p) for p in self.fs.ls(path) if Path(str(p)).name in self.files]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def pretrained_reader(directory: Path) -> Any:
    """A DCP storage reader of a ``transformers`` directory that reads only
    the files its index names (``model.safetensors`` without an index), so
    files an unfinished export left beside them are never read."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    files = indexed_files(directory) or {"model.safetensors"}
    reader.fs = _Listing(reader.fs, files)  # type: ignore[assignment]
    return reader


class _FileTensor(Pieces):
    """A whole tensor of a safetensors file, read only when DCP writes it."""

    def __init__(self, file: Path, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__(shape, dtype)
        self.file, self.name = file, name
        self.boxes = [(_whole_box(shape), torch.empty(0, dtype=dtype))]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(self.name)
        return tensor


def _whole_box(shape: torch.Size) -> Any:
    from pc_zero import Box

    return Box((0,) * len(shape), tuple(shape), 0)


def import_pretrained(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Write the ``transformers`` directory ``directory`` (safetensors
    files) as a sharded checkpoint in ``out`` that
    :meth:`~pc_booster.Booster.load_model` loads under any plugin, each
    rank reading only its share; one tensor in memory at a time."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict_saver import save

    source = Path(directory)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{source} holds no .safetensors files: pass a directory written by "
            "save_pretrained (or Booster.export_pretrained)."
        )
    state: dict[str, Any] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                view = f.get_slice(name)
                dtype = _dtype_of(view.get_dtype())
                state[_PREFIX + name] = _FileTensor(file, name, torch.Size(view.get_shape()), dtype)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    clear_links(target)  # never written through [Note: paths pc touches]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save(
            state,
            checkpoint_id=str(target),
            planner=PiecesSavePlanner(flatten_state_dict=False),
            no_dist=True,
        )
    config = source / "config.json"
    if config.exists():
        text = config.read_text()
        atomic_write(target / "config.json", lambda p: p.write_text(text))


def _dtype_of(name: str) -> torch.dtype:
    for dtype, short in _DTYPES.items():
        if short == name:
            return dtype
    raise ValueError(f"safetensors dtype {name} is not one pc reads.")
