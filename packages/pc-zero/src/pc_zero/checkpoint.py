"""Sharded checkpoints of ZeRO-3 models and their optimizers, written with
torch.distributed.checkpoint (DCP), loadable at any world size.

[Note: sharded checkpoint layout]
Each rank writes only what it owns: for every parameter, the part of its
flattened values that lies in this rank's shard, under the key
``model::<name>@<start>`` (start: the part's offset in the flattened
parameter), and likewise every element-wise optimizer state
(``optim::<name>::<state>@<start>``). Per-parameter scalars (Adam's
``step``), buffers and the param groups' hyperparameters are the same on
every rank and are written once (DCP keeps one copy of a key that several
ranks save). DCP writes the files in parallel and the metadata atomically.
Loading reads the metadata, asks DCP for every saved part that overlaps a
part this rank owns now, and copies the overlaps: so a checkpoint saved at
one world size (or by FSDP) loads at another (or into GeminiDDP), and at
world size 1 without a process group.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer

from pc_zero.pieces import PiecesLoadPlanner
from pc_zero.safe_load import (
    SafeFileSystemReader,
    legacy_loads,
    named_dcp_failures,
    safe_load_bytes,
)
from pc_zero.sharded import ShardedModule

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint"]

_PART = re.compile(r"^(?P<base>.+)@(?P<start>\d+)$")


def _parts(model: ShardedModule) -> list[tuple[str, torch.nn.Parameter, int, torch.Tensor]]:
    out = []
    for chunk in model.chunks:
        for param, start, part in chunk.shard_parts():
            out.append((model.name_of(param), param, start, part))
    return out


def save_sharded_checkpoint(
    path: str | Path, model: ShardedModule, optimizer: Optimizer | None = None
) -> None:
    """Write ``model`` (and ``optimizer``, built over its parameters) to the
    directory ``path`` [Note: sharded checkpoint layout]. Every rank calls it."""
    model._check_idle("save_sharded_checkpoint()")
    state: dict[str, Any] = {}
    for name, param, start, part in _parts(model):
        if part.numel():
            state[f"model::{name}@{start}"] = part.detach()
        if optimizer is None:
            continue
        for key, value in optimizer.state.get(param, {}).items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == 1
                and value.numel() == (part.numel())
            ):
                if part.numel():
                    state[f"optim::{name}::{key}@{start}"] = value.detach()
            else:
                state[f"optim::{name}::{key}"] = _blob(value)
    for name, buffer in model.module.named_buffers():
        state[f"buffer::{name}"] = buffer.detach()
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state["optim_groups"] = _blob(groups)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            state["loss_scaler"] = _blob(scaler.state_dict())
    dcp_save(state, checkpoint_id=str(path))


def _blob(value: Any) -> bytes:
    """Objects (hyperparameters, scalars) go in as one opaque value: DCP
    would otherwise flatten dicts and lists into many keys. Written with
    ``torch.save``, read with its weights-only unpickler."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(data: bytes, source: str) -> Any:
    """What :func:`_blob` wrote; a blob of earlier versions (a bare pickle)
    through the restricted unpickler [Note: loading runs no code]."""
    if data[:2] == b"PK":  # torch.save's zip format
        return safe_load_bytes(io.BytesIO(data), source)
    return legacy_loads(data, source)


def _overlaps(
    saved: dict[str, list[tuple[int, int]]], base: str, start: int, numel: int
) -> list[tuple[str, int, int]]:
    """Saved keys of ``base`` overlapping [start, start + numel): (key, saved
    start, saved length)."""
    found = []
    for s, n in saved.get(base, []):
        if s < start + numel and start < s + n:
            found.append((f"{base}@{s}", s, n))
    return found


def load_sharded_checkpoint(
    path: str | Path, model: ShardedModule, optimizer: Optimizer | None = None
) -> None:
    """Read a checkpoint written by :func:`save_sharded_checkpoint` at any
    world size into ``model`` (and ``optimizer``). Every rank calls it."""
    model._check_idle("load_sharded_checkpoint()")
    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved: dict[str, list[tuple[int, int]]] = {}
    for key, meta in metadata.items():
        match = _PART.match(key)
        if match and isinstance(meta, TensorStorageMetadata):
            saved.setdefault(match["base"], []).append((int(match["start"]), meta.size[0]))
    request: dict[str, Any] = {}
    for key, meta in metadata.items():
        if _PART.match(key):
            continue
        if key.startswith("buffer::") or (optimizer is not None and not key.startswith("model")):
            if isinstance(meta, TensorStorageMetadata):
                request[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            else:
                request[key] = b""  # an object: DCP fills it in
    optim_bases: dict[str, list[str]] = {}  # parameter name -> its saved state keys
    for base in saved:
        if base.startswith("optim::"):
            optim_bases.setdefault(base.split("::")[1], []).append(base)
    targets: list[tuple[torch.Tensor, int, str]] = []  # (destination, its start, base key)
    parts = _parts(model)
    for name, param, start, part in parts:
        targets.append((part, start, f"model::{name}"))
        if optimizer is not None:
            for base in optim_bases.get(name, []):
                state = optimizer.state.setdefault(param, {})
                key = base.rsplit("::", 1)[1]
                state[key] = torch.zeros_like(part)
                targets.append((state[key], start, base))
    missing = [base for dest, start, base in targets if base not in saved and dest.numel()]
    if any(m.startswith("model::") for m in missing):
        raise KeyError(
            f"checkpoint at {path} has no values for {sorted(set(missing))[:5]}: it was saved "
            "from a different model."
        )
    for dest, start, base in targets:
        for key, _s, n in _overlaps(saved, base, start, dest.numel()):
            request.setdefault(key, torch.empty(n, dtype=dest.dtype))
    with named_dcp_failures(f"checkpoint {path} does not load"):
        dcp_load(
            request,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=PiecesLoadPlanner(flatten_state_dict=False),
        )
    with torch.no_grad():
        for dest, start, base in targets:
            for key, s, n in _overlaps(saved, base, start, dest.numel()):
                lo, hi = max(start, s), min(start + dest.numel(), s + n)
                dest[lo - start : hi - start].copy_(request[key][lo - s : hi - s])
        for name, buffer in model.module.named_buffers():
            if f"buffer::{name}" in request:
                buffer.copy_(request[f"buffer::{name}"])
    if optimizer is None:
        return
    for name, param, _start, _part in parts:
        for key, value in request.items():
            prefix = f"optim::{name}::"
            if key.startswith(prefix) and not _PART.match(key):
                if isinstance(value, bytes):
                    value = _unblob(value, f"{path} item {key}")
                optimizer.state.setdefault(param, {})[key[len(prefix) :]] = value
    if "optim_groups" in request:
        groups = _unblob(request["optim_groups"], f"{path} item optim_groups")
        for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved_group)
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and "loss_scaler" in request:
        scaler.load_state_dict(_unblob(request["loss_scaler"], f"{path} item loss_scaler"))
