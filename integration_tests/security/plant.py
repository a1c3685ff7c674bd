"""What an attacker does to a checkpoint: plant a pickle whose ``__reduce__``
runs a shell command (it appends to a marker file) in one of its files,
keeping the file loadable by pickle, and update every checksum pc keeps
(DCP sidecars, pc-train's trainer state), so that only the loader's own
refusal to run code stands between the file and the payload."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from pc_booster.checkpoint.checksum import CHECKSUMS, file_checksum


class Payload:
    """Unpickling this runs ``echo ran >> marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"echo ran >> {self.marker}",))


def plant_pt(file: Path, marker: Path) -> None:
    """A ``torch.save`` file: the payload added to its dict (or in place of it)."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    state = {**state, "extra": Payload(marker)} if isinstance(state, dict) else Payload(marker)
    torch.save(state, file)


def _metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as file:
        return pickle.load(file)  # the attacker's own tool: trusted here


def _save_metadata(directory: Path, metadata: Any) -> None:
    with open(directory / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def plant_metadata(directory: Path, marker: Path) -> None:
    """DCP's ``.metadata``: still the metadata, with the payload inside."""
    metadata = _metadata(directory)
    metadata.planner_data = {"extra": Payload(marker)}
    _save_metadata(directory, metadata)


def plant_items(directory: Path, marker: Path, *, raw_pickle: bool = False) -> int:
    """Every non-tensor item of a DCP directory (the optimizer's param
    groups, per-parameter scalars): its ``torch.save`` bytes replaced by a
    ``torch.save`` of the payload, or, with ``raw_pickle``, of a bytes
    value holding a bare pickle of it (pc-zero's blobs of earlier
    versions). The files are spliced and the offsets rewritten. Returns
    how many items were planted."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _metadata(directory)
    objects = {
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    }
    buffer = io.BytesIO()
    torch.save(pickle.dumps(Payload(marker)) if raw_pickle else Payload(marker), buffer)
    evil = buffer.getvalue()
    planted = 0
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        old = (directory / name).read_bytes()
        entries = sorted(
            ((index, info) for index, info in metadata.storage_data.items()
             if info.relative_path == name),
            key=lambda pair: pair[1].offset,
        )  # fmt: skip
        new = bytearray()
        cursor = 0
        for index, info in entries:
            begin, end = info.offset, info.offset + info.length
            new += old[cursor:begin]
            data = old[begin:end]
            if index.fqn in objects:
                data, planted = evil, planted + 1
            info.offset, info.length = len(new), len(data)
            new += data
            cursor = end
        new += old[cursor:]
        (directory / name).write_bytes(bytes(new))
    _save_metadata(directory, metadata)
    return planted


def refresh_checksums(root: Path) -> None:
    """Recompute every checksum pc keeps under ``root``: DCP sidecars and
    pc-train's ``trainer_state.json`` (sizes and checksums)."""
    for sidecar in root.rglob(CHECKSUMS):
        sums = json.loads(sidecar.read_text())
        sidecar.write_text(json.dumps({n: file_checksum(sidecar.parent / n) for n in sums}))
    for state_file in root.rglob("trainer_state.json"):
        state = json.loads(state_file.read_text())
        base = state_file.parent
        if "files" in state:
            state["files"] = {n: (base / n).stat().st_size for n in state["files"]}
        if "checksums" in state:
            state["checksums"] = {n: file_checksum(base / n) for n in state["checksums"]}
        state_file.write_text(json.dumps(state))
