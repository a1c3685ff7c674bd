"""Sharded checkpoints: each rank's share of the canonical state as
``torch.distributed.checkpoint`` (DCP) items [Note: sharded canonical state].

[Note: sharded canonical state]
The keys are the same under every plugin, so DCP's resharding makes a
checkpoint saved under any plugin and world size load under any other:

- ``model/<name>``: each parameter's true values in fp32 (the masters where
  a plugin keeps them), and each buffer, with its whole shape;
- ``optim/<name>/<key>``: each element-wise optimizer state (fp32, the
  parameter's shape) and each scalar one (Adam's ``step``, a 0-dim tensor);
- ``optim/param_groups``: the groups' hyperparameters and parameter names;
  ``optim/loss_scaler``: the fp16 loss scale's state, where there is one.

A plugin gives, per key, what this rank holds: a :class:`pc_zero.Pieces`
of flat ranges (ZeRO, chunks), a DTensor (FSDP2) or a whole tensor (every
rank holds it; DCP writes it once). Every rank writes only that, and on
load reads only the byte ranges that overlap it. A :class:`Share` says
which tensors a rank writes (a pipeline stage: its own; a weight tied
across stages: the stage that trains it, while every stage holding a copy
reads it back) and where its tensor-parallel shards sit in the full
tensors (pc-tensor's :func:`~pc_tensor.place_local_box`: a fused
projection's parts land apart, vocabulary padding is never written,
``Conv1D`` weights are written in their original layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState, canonical_to_torch
from pc_tensor import ShardSpec, full_shape, place_local_box
from pc_zero import Pieces, flat_range_boxes

__all__ = [
    "GROUPS",
    "SCALER",
    "WHOLE",
    "Share",
    "after_own_optimizer_load",
    "apply_groups",
    "buffers_state",
    "canonical_model_keys",
    "groups_state",
    "model_key",
    "optim_key",
    "own_optimizer_state",
    "restore_scalars",
    "saved_state_keys",
    "staged",
    "torch_optimizer_targets",
    "whole_state",
    "zero_model_state",
]

GROUPS = "optim/param_groups"
SCALER = "optim/loss_scaler"


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


@dataclass(frozen=True)
class Share:
    """What this rank holds of the canonical state [Note: sharded canonical
    state]: ``names``, the tensors (parameter and buffer names) it writes
    or reads (None: every one it has); under tensor parallelism
    ``tp_specs`` (pc-tensor's, by name), ``tp_rank`` and ``tp_world`` say
    where its shards sit in the full tensors. The default is a rank that
    holds its tensors whole."""

    names: frozenset[str] | None = None
    tp_specs: Mapping[str, ShardSpec] = field(default_factory=dict)
    tp_rank: int = 0
    tp_world: int = 1
    # Tensors split over another group than the tensor-parallel one (expert
    # shards over the expert-parallel ranks): name -> (rank, size) there.
    groups: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def holds(self, name: str) -> bool:
        return self.names is None or name in self.names

    def _where(self, name: str) -> tuple[int, int]:
        """This rank's place and the group's size for ``name``'s split."""
        return self.groups.get(name, (self.tp_rank, self.tp_world))

    def full_shape(self, name: str, local_shape: torch.Size) -> torch.Size:
        spec = self.tp_specs.get(name)
        world = self._where(name)[1]
        return full_shape(spec, local_shape, world) if spec is not None else local_shape

    def pieces(self, name: str, local_shape: torch.Size) -> Pieces:
        """An empty fp32 :class:`~pc_zero.Pieces` of the full tensor."""
        return Pieces(self.full_shape(name, local_shape), torch.float32)

    def add_range(
        self,
        target: Pieces,
        name: str,
        local_shape: torch.Size,
        start: int,
        values: torch.Tensor,
    ) -> None:
        """Add ``values``, elements ``start...`` of this rank's flattened
        tensor of ``local_shape`` (a ZeRO or chunk range), to ``target``."""
        spec = self.tp_specs.get(name)
        if spec is None:
            target.add_flat(start, values)
            return
        for box in flat_range_boxes(local_shape, start, start + values.numel()):
            lo = box.flat_start - start
            view = values[lo : lo + box.numel].view(box.sizes)
            self._add_box(target, name, spec, local_shape, box.offsets, view)

    def whole(self, name: str, tensor: torch.Tensor) -> Any:
        """This rank's whole tensor (a tensor-parallel shard: its place in
        the full tensor), backed by ``tensor`` itself."""
        spec = self.tp_specs.get(name)
        if spec is None:
            return tensor.detach()
        target = Pieces(self.full_shape(name, tensor.shape), tensor.dtype)
        self._add_box(target, name, spec, tensor.shape, (0,) * tensor.dim(), tensor.detach())
        return target

    def _add_box(
        self,
        target: Pieces,
        name: str,
        spec: ShardSpec,
        local_shape: torch.Size,
        offsets: Sequence[int],
        values: torch.Tensor,
    ) -> None:
        offsets = tuple(offsets)
        rank, world = self._where(name)
        placed = place_local_box(spec, local_shape, rank, world, offsets, tuple(values.shape))
        for full_offsets, local_offsets, local_sizes in placed:
            part = values
            for dim, (lo, size) in enumerate(zip(local_offsets, local_sizes, strict=True)):
                part = part.narrow(dim, lo - offsets[dim], size)
            target.add_box(full_offsets, part.t() if spec.transpose else part)


WHOLE = Share()


def whole_state(module: nn.Module, share: Share = WHOLE) -> dict[str, Any]:
    """Every parameter and persistent buffer ``share`` holds, as this rank
    has it (whole, a DTensor, or its tensor-parallel shard), by canonical
    key."""
    out: dict[str, Any] = {
        model_key(n): share.whole(n, p) for n, p in module.named_parameters() if share.holds(n)
    }
    return {**out, **buffers_state(module, share)}


def zero_model_state(
    module: nn.Module,
    shapes: Mapping[str, torch.Size],
    pieces: Iterable[tuple[str, int, torch.Tensor]],
    share: Share = WHOLE,
) -> dict[str, Any]:
    """A model whose sharded parameters (``shapes``: name -> this rank's
    shape of it) keep their true values as fp32 pieces of their flattened
    values, ``(name, start, values)`` for this rank; every other parameter
    ``share`` holds as this rank has it."""
    out: dict[str, Any] = {
        model_key(name): share.pieces(name, shape)
        for name, shape in shapes.items()
        if share.holds(name)
    }
    for name, start, values in pieces:
        if share.holds(name):
            share.add_range(out[model_key(name)], name, shapes[name], start, values)
    for name, param in module.named_parameters():
        if share.holds(name) and model_key(name) not in out:
            out[model_key(name)] = share.whole(name, param)
    return {**out, **buffers_state(module, share)}


def buffers_state(module: nn.Module, share: Share = WHOLE) -> dict[str, Any]:
    """Every persistent buffer ``share`` holds, whole (each rank holds it)."""
    persistent = set(module.state_dict())
    return {
        model_key(n): b.detach()
        for n, b in module.named_buffers()
        if n in persistent and share.holds(n)
    }


def canonical_model_keys(module: nn.Module) -> set[str]:
    """The model keys a sharded checkpoint of ``module`` has, whatever the
    plugin and layout (every rank's share together)."""
    persistent = set(module.state_dict())
    names = [n for n, _ in module.named_parameters()]
    names += [n for n, _ in module.named_buffers() if n in persistent]
    return {model_key(n) for n in names}


def saved_state_keys(metadata: Mapping[str, Any]) -> dict[str, dict[str, bool]]:
    """Per parameter name, the optimizer-state keys a checkpoint holds and
    whether each is element-wise (a tensor with dimensions) or a scalar."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, dict[str, bool]] = {}
    for fqn, md in metadata.items():
        if not fqn.startswith("optim/") or fqn in (GROUPS, SCALER):
            continue
        name, _, key = fqn.removeprefix("optim/").rpartition("/")
        elementwise = isinstance(md, TensorStorageMetadata) and len(md.size) > 0
        out.setdefault(name, {})[key] = elementwise
    return out


def torch_optimizer_targets(
    optimizer: Optimizer,
    names: Mapping[int, str],
    saved: Mapping[str, Mapping[str, bool]] | None,
    share: Share = WHOLE,
) -> dict[str, Any]:
    """A plain torch optimizer's state by canonical key, its state tensors
    themselves (DTensors under FSDP2, tensor-parallel shards placed by
    ``share``). ``saved`` (loading): the keys the checkpoint has; a
    parameter without state yet gets zeros to be filled."""
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or not share.holds(name):
                continue
            state = optimizer.state[param]
            if saved is not None:
                for key, elementwise in saved.get(name, {}).items():
                    if key not in state:
                        state[key] = (
                            torch.zeros_like(param, dtype=torch.float32)
                            if elementwise
                            else torch.zeros((), dtype=torch.float32)
                        )
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    whole = value.dim() > 0 and name in share.tp_specs
                    out[optim_key(name, key)] = share.whole(name, value) if whole else value
                else:  # a Python number: saved as a 0-dim tensor
                    out[optim_key(name, key)] = torch.tensor(float(value))
    return out


def own_optimizer_state(
    module: nn.Module,
    optimizer: Optimizer,
    saved: Mapping[str, Mapping[str, bool]] | None,
    share: Share = WHOLE,
) -> dict[str, Any]:
    """The user's own optimizer over ``module``'s tensors (whole,
    DTensors or tensor-parallel shards): its states and groups by
    canonical key."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        **torch_optimizer_targets(optimizer, names, saved, share),
        GROUPS: groups_state(optimizer, names),
    }


def after_own_optimizer_load(module: nn.Module, optimizer: Optimizer, state: Any) -> None:
    """The hyperparameters a sharded load read into the user's optimizer."""
    apply_groups(optimizer, {id(p): n for n, p in module.named_parameters()}, state.get(GROUPS))


class HasParamGroups(Protocol):
    """An optimizer's param groups (a torch optimizer's, or a ZeRO one's,
    whose groups hold master pieces)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def groups_state(
    optimizer: HasParamGroups,
    names: Mapping[int, str],
    members: Sequence[Sequence[torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """The param groups' hyperparameters, with their parameters by name;
    ``members``: each group's model parameters where the groups hold
    something else (a ZeRO optimizer's master pieces)."""
    members = members if members is not None else [g["params"] for g in optimizer.param_groups]
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in params if id(p) in names],
        }
        for group, params in zip(optimizer.param_groups, members, strict=True)
    ]


def apply_groups(
    optimizer: HasParamGroups,
    names: Mapping[int, str],
    saved: Any,
    members: Sequence[Sequence[torch.Tensor]] | None = None,
) -> None:
    """Each group's hyperparameters from the saved group holding the same
    parameters (as the canonical load does); ``members`` as for
    :func:`groups_state`."""
    if saved is None:  # not in the checkpoint: the groups stay as they are
        return
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise ValueError(
            f"the checkpoint's {GROUPS} is a {type(saved).__name__}, not a list of dicts (one "
            "per parameter group): the checkpoint is damaged or was not written by pc."
        )
    members = members if members is not None else [g["params"] for g in optimizer.param_groups]
    order = [names.get(id(p)) for params in members for p in params]
    canonical: CanonicalOptimizerState = {"state": {}, "param_groups": saved}
    groups, offset = [], 0
    for group, params in zip(optimizer.param_groups, members, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append((list(range(offset, offset + len(params))), hyper))
        offset += len(params)
    converted = canonical_to_torch(canonical, order, groups)
    for group, new in zip(optimizer.param_groups, converted["param_groups"], strict=True):
        group.update({k: v for k, v in new.items() if k != "params"})


def restore_scalars(entry: dict[str, Any], state: Mapping[str, Any], name: str) -> None:
    """Put the scalars a sharded load read for parameter ``name`` into an
    optimizer state ``entry`` (its element-wise states were written in
    place), each in the type it had."""
    for key, value in list(entry.items()):
        loaded = state.get(optim_key(name, key))
        if loaded is None or (isinstance(value, torch.Tensor) and value.dim() > 0):
            continue
        entry[key] = (
            loaded.clone() if isinstance(value, torch.Tensor) else type(value)(loaded.item())
        )


# [Note: staging beside training]
# An async save copies this rank's share to host memory in two parts. At
# the call (:func:`held`): the state's structure, every value that is not
# a tensor (deep-copied: hyperparameters, the loss scale) and the tensors
# that training may change before its next optimizer step (the module's
# buffers, which a forward updates in place, e.g. batch-norm statistics)
# or that are too small to be worth deferring (step counts, scalars); the
# other tensors are kept as the live ones. Then, on a background thread
# (:func:`staged`), those are copied into host buffers while the next
# forward and backward run; only an optimizer step changes them, and the
# Booster makes every step wait for the copy (on a GPU, host buffers are
# pinned and the copies run on a side stream, ordered after the work queued
# at the call).

_COPY_NOW_BELOW = 1 << 16  # elements: tensors smaller than this are copied at the call


@dataclass
class Held:
    """What :func:`held` takes at an async save's call: the state, part
    copied, part live, and on a GPU an event after the work queued then."""

    state: dict[str, Any]
    ready: Any = None  # torch.cuda.Event, recorded on the caller's stream


def held(state: dict[str, Any], changing: Iterable[torch.Tensor] = ()) -> Held:
    """The call-time part of an async save ([Note: staging beside
    training]): ``state`` with every non-tensor value deep-copied and the
    tensors that share storage with one of ``changing`` (tensors training
    may change before its next optimizer step: a module's buffers) or have
    fewer than 65,536 elements cloned; the others stay live."""
    import copy

    from torch.distributed.tensor import DTensor

    storages = {t.untyped_storage().data_ptr() for t in changing if t.numel()}

    def now(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.numel() < _COPY_NOW_BELOW or tensor.untyped_storage().data_ptr() in storages:
            return tensor.clone()
        return tensor

    out: dict[str, Any] = {}
    cuda = False
    for key, value in state.items():
        if isinstance(value, Pieces):
            twin = Pieces(value.shape, value.dtype)
            twin.boxes = [(box, now(v)) for box, v in value.boxes]
            cuda = cuda or any(v.is_cuda for _, v in value.boxes)
            out[key] = twin
        elif isinstance(value, DTensor):  # rebuilt around its copy by staged()
            local = value.to_local()
            cuda = cuda or local.is_cuda
            out[key] = _Local(value, now(local))
        elif isinstance(value, torch.Tensor):
            cuda = cuda or value.is_cuda
            out[key] = now(value)
        else:
            out[key] = copy.deepcopy(value)
    ready = None
    if cuda:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()  # the caller's current stream: the copies go after it
    return Held(out, ready)


@dataclass
class _Local:
    """A DTensor's local shard (or its copy) kept apart from the DTensor,
    which costs more to build than to copy a small shard."""

    like: Any  # the DTensor
    local: torch.Tensor


def _dtensor_like(value: Any, local: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def staged(
    state: dict[str, Any] | Held, buffers: dict[Any, torch.Tensor] | None = None
) -> dict[str, Any]:
    """A copy of a sharded state in host memory that training may run on
    beside (an async save writes it): each tensor, each piece of a
    :class:`~pc_zero.Pieces` and each DTensor's local shard copied, every
    other value deep-copied. Costs this rank's share once. ``buffers``:
    host tensors kept from an earlier staging of the same state, reused
    where shape, stride and dtype match (the copy then touches no fresh
    pages), and filled with the new ones; the caller must know the earlier
    copy is written. From a :class:`Held` (any thread): the copies of GPU
    tensors go into pinned buffers on a side stream after the held event,
    and this returns once they are done."""
    import copy

    from torch.distributed.tensor import DTensor

    ready = state.ready if isinstance(state, Held) else None
    values = state.state if isinstance(state, Held) else state
    stream = None
    if ready is not None:
        stream = torch.cuda.Stream(device=ready.device)  # type: ignore[no-untyped-call]
        stream.wait_event(ready)

    def host(key: Any, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        kept = buffers.get(key) if buffers is not None else None
        if (
            kept is None
            or kept.shape != tensor.shape
            or kept.stride() != tensor.stride()
            or kept.dtype != tensor.dtype
        ):
            kept = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, pin_memory=tensor.is_cuda
            )
            if buffers is not None:
                buffers[key] = kept
        if tensor.is_cuda and stream is not None:
            with torch.cuda.stream(stream):
                tensor.record_stream(stream)  # held until the copy is done
                kept.copy_(tensor, non_blocking=True)
        else:
            kept.copy_(tensor)
        return kept

    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Pieces):
            twin = Pieces(value.shape, value.dtype)
            twin.boxes = [(box, host((key, i), v)) for i, (box, v) in enumerate(value.boxes)]
            out[key] = twin
        elif isinstance(value, DTensor):
            out[key] = _dtensor_like(value, host(key, value.to_local()))
        elif isinstance(value, _Local):
            out[key] = _dtensor_like(value.like, host(key, value.local))
        elif isinstance(value, torch.Tensor):
            out[key] = host(key, value)
        else:
            out[key] = copy.deepcopy(value)
    if stream is not None:
        stream.synchronize()
    return out
