"""The files of a checkpoint: their names and forms, single-file reads and
writes' helpers, DCP's sharded save and load of one state, checksums of
what is read, and tied weights' aliases."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_booster.checkpoint import checksum
from pc_booster.checkpoint.disk import DiskWriteError, named_disk_errors
from pc_booster.checkpoint.export import atomic_write, indexed_files, remove_files
from pc_booster.checkpoint.paths import clear_links, remove_named

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's commit point
# Every write and removal of a save goes through these two, read from this
# module at each call (the atomic-save test stops a save at each of them).
atomic = atomic_write
remove = remove_files


# [Note: single-file arguments]
# Programs written for the original Booster pass size_per_shard and use_async
# with shard=False (docs/migrate-colossalai.md).
# One file has no shards, and it is gathered whole before it is written, so
# there is nothing to stage in the background: both are accepted and have
# no effect; with use_async the save returns a future that is already done
# (the file is complete when save_model returns).


def done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


# [Note: sharded saves]
# DCP's .metadata is the commit point of a sharded checkpoint; the index is
# that of an exported one. New export files never take a name the current
# index uses (they get a fresh token when the plain names are taken), the
# index is replaced last, and only then are the files only the old index
# named removed; loads read only the files the index names. A save killed
# before the index is replaced leaves the old index and all its files;
# after, the new ones. The single file model.safetensors is replaced in one
# rename; a stale index next to it (load_model prefers an index) is removed
# after that rename.


def named_failures(what: str) -> AbstractContextManager[None]:
    """pc-zero's :func:`~pc_zero.named_dcp_failures`: a rank's DCP failure
    raised as the error it wraps, naming the rank."""
    from pc_zero import named_dcp_failures

    return named_dcp_failures(what)


# [Note: checkpoint forms]
# save_model(shard=False) in the original Booster writes one file at the path it is
# given, which its users torch.load; pc did so only as a directory of
# transformers' layout. Both are kept: a path with a file suffix is a file,
# any other path a directory (model.safetensors + config.json). shard=True
# is DCP's directory (every rank its share), or with use_safetensors=True
# transformers' sharded safetensors streamed without gathering, which is
# what the original's sharded form is (docs/migrate-colossalai.md).
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def is_file_name(path: Path) -> bool:
    return not path.is_dir() and path.suffix in FILE_SUFFIXES


def one_reader(call: str, num_threads: int) -> None:
    """``num_threads`` of the loads: pc reads with one thread per rank."""
    if num_threads != 1:
        raise ValueError(
            f"{call}: num_threads={num_threads}; pc reads with one thread per rank, each rank "
            "its own share in parallel. Pass num_threads=1."
        )


def refuse_prefix(prefix: str | None) -> None:
    if prefix is not None:
        raise ValueError(
            f"prefix={prefix!r}: pc names a sharded checkpoint's files as "
            "torch.distributed.checkpoint (or transformers, for use_safetensors=True) does; "
            "drop prefix, or save into a directory of its own."
        )


def file_count(state: dict[str, Any], size_per_shard: int | None) -> int:
    """How many files this rank's share goes into: about ``size_per_shard``
    MiB each (one when None)."""
    if size_per_shard is None:
        return 1
    if size_per_shard <= 0:
        raise ValueError(f"size_per_shard must be a positive number of MiB, got {size_per_shard}.")
    return max(1, -(-share_bytes(state) // (size_per_shard * 2**20)))


def share_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors of this rank's share of ``state``."""
    from torch.distributed.tensor import DTensor

    from pc_zero import Pieces

    total = 0
    for value in state.values():
        if isinstance(value, Pieces):
            total += sum(t.numel() * t.element_size() for _, t in value.boxes)
        elif isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def read_file(path: Path) -> dict[str, torch.Tensor]:
    """A single-file checkpoint: safetensors, or torch.save's state dict
    (mapped, so its pages are read only as they are copied)."""
    if path.suffix == ".safetensors" or is_safetensors(path):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as header:
            metadata = header.metadata()
        tensors = load_file(str(path))
        checksum.check_tensors(path, tensors, metadata)  # in memory: no second read
        return tensors
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{path} is not a model checkpoint: expected a state dict of tensors (what "
            "Booster.save_model or torch.save(model.state_dict()) writes)."
        )
    return state


def is_safetensors(path: Path) -> bool:
    """safetensors files start with an 8-byte header length, then '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def with_checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """A safetensors header's metadata: the format transformers expects
    and every tensor's checksum (:mod:`.checksum`)."""
    return {"format": "pt", **checksum.tensor_checksums(state)}


def distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): copies."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        value = value.detach().cpu().contiguous()
        if value.data_ptr() in seen:
            value = value.clone()
        seen.add(value.data_ptr())
        out[key] = value
    return out


def check_index_names(directory: Path, names: Iterable[str] | None = None) -> None:
    """The files the safetensors index of ``directory`` names (``names``:
    as read already) are safetensors files by name: a pickle named there is
    refused, naming it, never read (:class:`~.checksum.ChecksumError`)."""
    listed = sorted(indexed_files(directory) if names is None else names)
    other = [name for name in listed if not name.endswith(".safetensors")]
    if other:
        raise checksum.ChecksumError(
            f"{directory / INDEX} names {other[0]}, which is not a safetensors file: an "
            "index of safetensors shards names .safetensors files only, and pc reads them as "
            "safetensors, never as pickles. Re-save the model with safetensors "
            "(save_pretrained(..., safe_serialization=True)), or fix the index."
        )


def verify_safetensors_files(directory: Path, collective: bool) -> None:
    """The safetensors files a load of ``directory`` reads (those its index
    names, else model.safetensors) against their checksums, split over the
    ranks with ``collective``."""
    names = sorted(indexed_files(directory) or {WEIGHTS})
    check_index_names(directory, names)
    files = [directory / name for name in names if (directory / name).is_file()]
    checks = [partial(checksum.verify_safetensors, file) for file in files]
    checksum.verify_split(checks, collective)


def save_sharded(
    state: dict[str, Any], out: Path, group: dist.ProcessGroup | None = None, files: int = 1
) -> None:
    """DCP writes every rank's items in parallel and the metadata last
    (the commit point); each rank's items go into ``files`` files of
    about equal size."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from pc_zero import PiecesSavePlanner

    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank(group)
    if rank == 0:  # the old sums go before any file they describe is replaced
        (out / checksum.CHECKSUMS).unlink(missing_ok=True)
        # Links planted where DCP writes its files by name are removed, never
        # written through (before any rank writes: DCP plans collectively first).
        clear_links(out)
    # A full disk or a read-only one is named, and this rank's unfinished
    # files removed [Note: disk errors named in pc_booster.checkpoint.disk].
    what = f"rank {rank}'s share of the sharded save"
    try:
        named = named_disk_errors(out, what, share_bytes(state))
        with named, named_failures(f"the sharded save to {out}"):
            planner = PiecesSavePlanner(flatten_state_dict=False)
            writer = FileSystemWriter(str(out), thread_count=files)
            metadata = save(state, storage_writer=writer, planner=planner, process_group=group)
    except DiskWriteError:
        _remove_unfinished(out, rank)
        raise
    # DCP names rank r's files __r_<k>.distcp; each rank hashes its own.
    own = {info.relative_path for info in (metadata.storage_data or {}).values()}
    checksum.write_sidecar(out, sorted(p for p in own if p.startswith(f"__{rank}_")), group)


def _remove_unfinished(out: Path, rank: int) -> None:
    """What a failed DCP save of rank ``rank`` left in ``out``: its data
    files (``__<rank>_<k>.distcp``) and, rank 0, the metadata's temporary
    file. The metadata of an earlier save stays; its data files written
    over are gone, so it is refused on load (missing files), not misread."""
    names = [p.name for p in out.glob(f"__{rank}_*.distcp")]
    if rank == 0:
        names.append(f"{DCP_METADATA}.tmp")
    remove_named(out, set(names), "a failed sharded save")  # pc's own names, listed here


def saved_keys(path: Path) -> dict[str, Any]:
    from pc_zero import read_metadata

    metadata: dict[str, Any] = read_metadata(path).state_dict_metadata
    return metadata


def load_sharded(state: dict[str, Any], path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    from pc_zero import PiecesLoadPlanner, SafeFileSystemReader

    with named_failures(f"checkpoint {path} does not load"):
        load(
            state,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=PiecesLoadPlanner(flatten_state_dict=False),
        )


def tied_source(module: nn.Module, key: str, present: Any = ()) -> str:
    """A key holding the same tensor as ``key`` (tied weights), one in
    ``present`` when there is one."""
    state = module.state_dict(keep_vars=True)
    target = state.get(key)
    aliases = [other for other, value in state.items() if value is target and other != key]
    for other in aliases:
        if other in present:
            return other
    return aliases[0] if aliases else key
