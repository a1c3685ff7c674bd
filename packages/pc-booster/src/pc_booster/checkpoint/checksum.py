"""Checksums of checkpoint files, written at save and verified at load, so
a file changed after it was saved (a bit flip on disk, a garbled copy)
is refused, naming the file, instead of loading wrong weights.

CRC-32 (``zlib.crc32``), streamed in 4 MiB blocks: never a whole file in
memory, about 2.2 GB/s per thread from the page cache (zlib releases the
GIL, so threads hash files in parallel); written as ``crc32:1a2b3c4d``.

- A sharded (DCP) directory gets ``.checksums.json`` (``{file: checksum}``):
  every rank hashes the ``.distcp`` files it wrote, in parallel, and rank 0
  writes the sidecar after DCP's ``.metadata``. A load splits the files
  over the ranks, each verifying its part, and every rank raises the first
  error found.
- A safetensors file carries per-tensor checksums in its header's
  ``__metadata__`` (key ``pc_crc32``: a JSON object ``{tensor: hex}``;
  ``transformers`` ignores the key). A full load checks the tensors it
  read, in memory; a directory's files are split over the ranks.

Files without checksums (earlier versions, other tools) load as before.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_booster.checkpoint.disk import DiskWriteError, named_disk_errors

__all__ = [
    "CHECKSUMS",
    "SAFETENSORS_KEY",
    "ChecksumError",
    "check_tensors",
    "crc_hex",
    "file_checksum",
    "file_checksums",
    "metadata_entry",
    "read_safetensors_header",
    "read_sidecar",
    "tensor_checksums",
    "verify_safetensors",
    "verify_sidecar",
    "verify_split",
    "write_sidecar",
]

CHECKSUMS = ".checksums.json"  # a sharded directory's sidecar
SAFETENSORS_KEY = "pc_crc32"  # in a safetensors header's __metadata__
_BLOCK = 4 * 2**20
_THREADS = 8


class ChecksumError(ValueError):
    """A checkpoint file whose bytes differ from those that were written."""


def _crc(value: int) -> str:
    return f"crc32:{value & 0xFFFFFFFF:08x}"


def _stream_crc(path: Path, begin: int = 0, end: int | None = None) -> int:
    """CRC-32 of ``path``'s bytes ``[begin, end)``, one block in memory."""
    crc = 0
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        stream.seek(begin)
        left = (os.fstat(stream.fileno()).st_size if end is None else end) - begin
        while left > 0:
            got = stream.readinto(view[: min(left, _BLOCK)])
            if not got:
                break
            crc = zlib.crc32(view[:got], crc)
            left -= got
    return crc


def file_checksum(path: str | os.PathLike[str]) -> str:
    """``path``'s checksum, streamed."""
    return _crc(_stream_crc(Path(path)))


def file_checksums(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """The checksums of ``directory``'s files ``names``, several at a time."""
    listed = sorted(names)
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(listed)))) as pool:
        sums = list(pool.map(lambda n: file_checksum(directory / n), listed))
    return dict(zip(listed, sums, strict=True))


# -- sharded (DCP) directories ---------------------------------------------------------


def write_sidecar(directory: Path, own: Sequence[str], group: dist.ProcessGroup | None) -> None:
    """Collective over ``group``: every rank hashes its files ``own`` of
    ``directory``; rank 0 writes them all to the sidecar."""
    sums = file_checksums(directory, own)
    world = dist.get_world_size(group)
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, sums, group=group)
    if dist.get_rank(group) == 0:
        every = {k: v for part in gathered if part for k, v in part.items()}
        tmp = directory / f".{CHECKSUMS}.tmp-{os.getpid()}"
        try:  # [Note: disk errors named in pc_booster.checkpoint.disk]
            with named_disk_errors(directory / CHECKSUMS, "the checksum sidecar's write"):
                tmp.write_text(json.dumps(dict(sorted(every.items())), indent=0))
                os.replace(tmp, directory / CHECKSUMS)
        except DiskWriteError:
            tmp.unlink(missing_ok=True)
            raise


def read_sidecar(directory: Path) -> dict[str, str]:
    """The sidecar's checksums; none when there is no sidecar."""
    try:
        loaded = json.loads((directory / CHECKSUMS).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as error:
        raise ChecksumError(
            f"checkpoint {directory} is corrupt: {CHECKSUMS} does not parse ({error}). "
            "Load an earlier checkpoint."
        ) from None
    if not isinstance(loaded, dict):
        raise ChecksumError(f"checkpoint {directory} is corrupt: {CHECKSUMS} is not a mapping.")
    return {str(k): str(v) for k, v in loaded.items()}


def _verify_file(directory: Path, name: str, expected: str) -> None:
    if not (directory / name).is_file():
        raise ChecksumError(
            f"checkpoint {directory} is incomplete: {name} is missing. Load an earlier checkpoint."
        )
    actual = file_checksum(directory / name)
    if actual != expected:
        raise ChecksumError(
            f"checkpoint {directory} is corrupt: {name} has checksum {actual}, {expected} was "
            "written. Load an earlier checkpoint."
        )


def verify_sidecar(directory: Path, collective: bool) -> None:
    """Verify the files the sidecar of ``directory`` lists (nothing without
    one): split over the default group's ranks with ``collective``."""
    sums = read_sidecar(directory)
    checks = [partial(_verify_file, directory, name, expected) for name, expected in sums.items()]
    verify_split(checks, collective)


def verify_split(checks: Sequence[Callable[[], None]], collective: bool) -> None:
    """Run ``checks`` (each raising :class:`ChecksumError`), several at a
    time; with ``collective`` (every rank of the default group calls it
    with the same list) each rank runs its part and every rank raises the
    first error any rank found."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
    problem: str | None = None
    mine = list(checks[rank::world])
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(mine)))) as pool:
            for done in [pool.submit(check) for check in mine]:
                done.result()
    except ChecksumError as error:
        problem = str(error)
    if collective:
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise ChecksumError(problem)


# -- safetensors -----------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def crc_hex(data: memoryview | bytes) -> str:
    """A tensor's bytes' CRC-32, as safetensors headers record it."""
    return f"{zlib.crc32(data):08x}"


def metadata_entry(sums: Mapping[str, str]) -> dict[str, str]:
    """The ``__metadata__`` entry that records each tensor's checksum."""
    return {SAFETENSORS_KEY: json.dumps(dict(sums), separators=(",", ":"), sort_keys=True)}


def tensor_checksums(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """:func:`metadata_entry` for the tensors of ``state``."""
    return metadata_entry({name: crc_hex(_tensor_bytes(t)) for name, t in state.items()})


def _recorded(file: Path, metadata: Mapping[str, str] | None) -> dict[str, str]:
    raw = (metadata or {}).get(SAFETENSORS_KEY)
    if raw is None:
        return {}
    try:
        sums = json.loads(raw)
        assert isinstance(sums, dict)
    except (ValueError, AssertionError):
        raise ChecksumError(
            f"checkpoint {file} is corrupt: its {SAFETENSORS_KEY} metadata does not parse."
        ) from None
    return {str(k): str(v) for k, v in sums.items()}


def _mismatch(file: Path, name: str, actual: str, expected: str) -> ChecksumError:
    return ChecksumError(
        f"checkpoint {file} is corrupt: tensor {name} has checksum crc32:{actual}, "
        f"crc32:{expected} was written. Load an earlier checkpoint."
    )


def check_tensors(
    file: Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> None:
    """``state``, as read from safetensors ``file``, against the checksums
    in its header's ``metadata`` (nothing to check without them)."""
    for name, expected in _recorded(file, metadata).items():
        if name in state:
            actual = crc_hex(_tensor_bytes(state[name]))
            if actual != expected:
                raise _mismatch(file, name, actual, expected)


# safetensors' own bound on a header; a longer one is not a safetensors file.
_MAX_HEADER = 100 * 2**20


def _not_safetensors(file: Path, head: bytes, why: str) -> ChecksumError:
    is_pickle = head[:4] == b"PK\x03\x04" or head[:1] == b"\x80"  # torch.save's zip, a bare pickle
    kind = "; it is a pickle (torch.save's format)" if is_pickle else ""
    return ChecksumError(
        f"{file} is not a safetensors file ({why}{kind}): pc reads it as safetensors only. "
        "Re-save the model with safetensors (save_pretrained(..., safe_serialization=True))."
    )


def read_safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of safetensors ``file`` and where its data starts,
    read within bounds: a file of another kind (a pickle named in an index)
    raises :class:`ChecksumError` naming it, never allocates what its first
    bytes claim."""
    with open(file, "rb") as stream:
        head = stream.read(8)
        size = os.fstat(stream.fileno()).st_size
        if len(head) < 8:
            raise _not_safetensors(file, head, f"it has {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            why = f"its first 8 bytes give a header of {length:,} bytes; the file has {size:,}"
            raise _not_safetensors(file, head, why)
        try:
            header = json.loads(stream.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise _not_safetensors(file, head, "its header is not a JSON object")
    return header, 8 + length


def verify_safetensors(file: Path) -> None:
    """Stream safetensors ``file``'s tensors against its checksums."""
    header, start = read_safetensors_header(file)
    for name, expected in _recorded(file, header.get("__metadata__")).items():
        entry = header.get(name)
        if entry is None:
            continue
        begin, end = entry["data_offsets"]
        actual = f"{_stream_crc(file, start + begin, start + end):08x}"
        if actual != expected:
            raise _mismatch(file, name, actual, expected)
