"""ZeRO-1/2 checkpoints, written per parameter so they load anywhere.

[Note: checkpoint format]
The full state dict is torch's optimizer format: ``state`` maps a
parameter's index (its position in the original optimizer's param groups)
to its entries shaped like the parameter (``exp_avg``, ``exp_avg_sq``, ...)
and scalars (``step``); ``param_groups`` holds each group's hyperparameters
and parameter indices. Two additions: ``master`` (the fp32 master of a
low-precision parameter, as pc-offload's optimizers name it) and a top-level
``loss_scaler``. A torch Adam/AdamW state dict loads into ZeRO, and ZeRO's
into torch's.

The sharded state dict is this rank's part only: per parameter, the pieces
it owns as ``{"__pieces__": [[start, flat_tensor], ...]}`` (start in the
parameter's flattened elements), plus the parameter shapes. Save one file
per rank; to load at any world size, read them all and pass
``merge_sharded_state_dicts(dicts)`` to ``load_state_dict``. Everything is
plain tensors, numbers, lists and dicts, so ``torch.load(weights_only=True)``
reads it.

This module only converts: it reads an optimizer through the public names
of :class:`BucketedShards` and never changes it; the optimizer applies what
:func:`plan_load` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from pc_comm import Communicator
from pc_offload import is_narrow, widen
from pc_zero.layout import Bucket
from pc_zero.loss_scale import DynamicLossScaler

__all__ = [
    "BucketedShards",
    "LoadPlan",
    "full_state_dict",
    "merge_sharded_state_dicts",
    "plan_load",
    "sharded_state_dict",
]

_SHARDED = "pc-zero-sharded/1"
_PIECES = "__pieces__"


class BucketedShards(Protocol):
    """A ZeRO-1/2 optimizer as its checkpoints read it: parameters laid out
    in ``buckets``, each cut into one piece per rank, with this rank's fp32
    master piece of bucket ``k`` at ``masters[k]``, stepped by ``inner``.
    :class:`pc_zero.LowLevelZeroOptimizer` is one."""

    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def group_indices(self) -> Sequence[Sequence[int]]: ...
    @property
    def masters(self) -> Sequence[torch.Tensor]: ...
    @property
    def buckets(self) -> Sequence[Bucket]: ...
    @property
    def inner(self) -> Optimizer: ...
    @property
    def comm(self) -> Communicator: ...
    @property
    def scaler(self) -> DynamicLossScaler | None: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...


@dataclass(frozen=True)
class LoadPlan:
    """What loading a full state dict changes, for the optimizer to apply:
    ``inner`` for its wrapped optimizer's ``load_state_dict``, ``masters``
    (bucket -> this rank's saved fp32 master piece; empty when the state
    holds none) and the ``loss_scaler`` state (or None)."""

    inner: dict[str, Any]
    masters: dict[int, torch.Tensor]
    loss_scaler: dict[str, Any] | None


def _entries(opt: BucketedShards, k: int) -> dict[str, Any]:
    """Bucket ``k``'s optimizer state on this rank, master included."""
    master = opt.masters[k]
    entries = dict(opt.inner.state.get(master, {}))
    for key, value in entries.items():  # fp32 in checkpoints, whatever the storage
        if isinstance(value, torch.Tensor) and is_narrow(value):
            entries[key] = widen(value)
    if entries and opt.dtype != torch.float32:
        entries["master"] = master
    return entries


def _is_elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _groups(opt: BucketedShards) -> list[dict[str, Any]]:
    groups = []
    for group, indices in zip(opt.inner.param_groups, opt.group_indices, strict=True):
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = list(indices)
        groups.append(saved)
    return groups


def _scaler(opt: BucketedShards) -> dict[str, Any] | None:
    return opt.scaler.state_dict() if opt.scaler is not None else None


def full_state_dict(opt: BucketedShards) -> dict[str, Any]:
    """The full state dict [Note: checkpoint format] (collective). The
    optimizer's reductions must have finished."""
    state: dict[int, dict[str, Any]] = {}
    for k, b in enumerate(opt.buckets):
        entries = _entries(opt, k)
        for key in sorted(entries):
            value = entries[key]
            if _is_elementwise(value, b.piece):
                full = torch.empty(b.numel, dtype=value.dtype, device=opt.device)
                opt.comm.all_gather(full, value.to(opt.device, copy=True))
                full = full.cpu()
                for slot in b.slots:
                    flat = full[slot.offset : slot.offset + slot.numel]
                    state.setdefault(slot.index, {})[key] = flat.view(slot.shape).clone()
            else:
                for slot in b.slots:
                    copy = value.detach().clone() if isinstance(value, torch.Tensor) else value
                    state.setdefault(slot.index, {})[key] = copy
    return {"state": state, "param_groups": _groups(opt), "loss_scaler": _scaler(opt)}


def sharded_state_dict(opt: BucketedShards) -> dict[str, Any]:
    """This rank's part [Note: checkpoint format]. The optimizer's
    reductions must have finished."""
    state: dict[int, dict[str, Any]] = {}
    for k, b in enumerate(opt.buckets):
        lo, hi = b.piece_range(opt.rank)
        entries = _entries(opt, k)
        for slot in b.slots:
            start, stop = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if start >= stop:
                continue
            mine = state.setdefault(slot.index, {})
            for key, value in entries.items():
                if _is_elementwise(value, b.piece):
                    piece = value[start - lo : stop - lo].detach().cpu().clone()
                    mine[key] = {_PIECES: [[start - slot.offset, piece]]}
                else:
                    mine[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    shapes = {i: list(p.shape) for i, p in enumerate(opt.params)}
    return {
        "format": _SHARDED,
        "world_size": opt.world_size,
        "rank": opt.rank,
        "shapes": shapes,
        "state": state,
        "param_groups": _groups(opt),
        "loss_scaler": _scaler(opt),
    }


def merge_sharded_state_dicts(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's ``sharded_state_dict()`` (any order) -> the full state
    dict [Note: checkpoint format]. Raises if a rank's file is missing."""
    if not shards or any(s.get("format") != _SHARDED for s in shards):
        raise ValueError(
            "merge_sharded_state_dicts expects the dicts from every rank's "
            "sharded_state_dict(); got something else."
        )
    world = int(shards[0]["world_size"])
    ranks = sorted(int(s["rank"]) for s in shards)
    if ranks != list(range(world)):
        raise ValueError(
            f"merge_sharded_state_dicts: the checkpoint was saved by {world} ranks, got the "
            f"files of ranks {ranks}. Pass one dict per rank."
        )
    shapes = {int(i): torch.Size(s) for i, s in shards[0]["shapes"].items()}
    pieces: dict[int, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    state: dict[int, dict[str, Any]] = {}
    for shard in shards:
        for index, entries in shard["state"].items():
            i = int(index)
            for key, value in entries.items():
                if isinstance(value, dict) and _PIECES in value:
                    got = [(int(s), t) for s, t in value[_PIECES]]
                    pieces.setdefault(i, {}).setdefault(key, []).extend(got)
                else:
                    state.setdefault(i, {})[key] = value
    for i, by_key in pieces.items():
        for key, parts in by_key.items():
            numel = shapes[i].numel()
            flat = torch.empty(numel, dtype=parts[0][1].dtype)
            covered = 0
            for start, piece in parts:
                flat[start : start + piece.numel()] = piece
                covered += piece.numel()
            if covered != numel:
                raise ValueError(
                    f"merge_sharded_state_dicts: parameter {i} '{key}' has {covered} of "
                    f"{numel} elements across the files; a rank's file is missing or stale."
                )
            state.setdefault(i, {})[key] = flat.view(shapes[i])
    return {
        "state": state,
        "param_groups": shards[0]["param_groups"],
        "loss_scaler": shards[0].get("loss_scaler"),
    }


def plan_load(opt: BucketedShards, state_dict: dict[str, Any]) -> LoadPlan:
    """A full state dict [Note: checkpoint format], cut to this rank's
    pieces; raises ``ValueError`` if it does not fit the optimizer."""
    if state_dict.get("format") == _SHARDED:
        raise ValueError(
            "load_state_dict got one rank's sharded state dict; read every rank's file and "
            "pass merge_sharded_state_dicts(dicts) instead."
        )
    saved_groups = state_dict["param_groups"]
    ours = opt.group_indices
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in ours]:
        raise ValueError(
            "load_state_dict: the saved param groups have "
            f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer has "
            f"{[len(g) for g in ours]}. Build the optimizer over the same model and groups."
        )
    # Saved index -> our index, by position in the groups.
    to_ours = {
        int(s): o
        for g, mine in zip(saved_groups, ours, strict=True)
        for s, o in zip(g["params"], mine, strict=True)
    }
    saved = {to_ours[int(i)]: v for i, v in state_dict["state"].items()}
    positions = {
        id(m): n for n, m in enumerate(p for g in opt.inner.param_groups for p in g["params"])
    }
    inner_state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for k, b in enumerate(opt.buckets):
        with_state = [s for s in b.slots if s.index in saved]
        if not with_state:
            continue
        lo, hi = b.piece_range(opt.rank)
        entries: dict[str, Any] = {}
        for key, sample in saved[with_state[0].index].items():
            if (
                isinstance(sample, torch.Tensor)
                and sample.numel() == with_state[0].numel
                and sample.dim() > 0
            ):
                piece = torch.zeros(b.piece, dtype=sample.dtype)
                for slot in with_state:
                    start, stop = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                    if start < stop:
                        flat = saved[slot.index][key].reshape(-1)
                        piece[start - lo : stop - lo] = flat[
                            start - slot.offset : stop - slot.offset
                        ]
                entries[key] = piece
            else:
                entries[key] = sample
        master = entries.pop("master", None)
        if master is not None:
            masters[k] = master
        inner_state[positions[id(opt.masters[k])]] = entries
    groups = []
    for group, saved_group in zip(opt.inner.param_groups, saved_groups, strict=True):
        loaded = {key: value for key, value in saved_group.items() if key != "params"}
        loaded["params"] = [positions[id(p)] for p in group["params"]]
        groups.append(loaded)
    return LoadPlan(
        {"state": inner_state, "param_groups": groups}, masters, state_dict.get("loss_scaler")
    )
