"""Expert parallelism for mixture-of-experts models: the experts of each
MoE block split over an expert-parallel group, tokens sent to the rank that
holds their expert and back by all-to-all with uneven splits.

[Note: the experts contract]
In ``transformers`` 5 an MoE block keeps its experts in one module whose
parameters are packed tensors with one leading entry per expert
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, biases ``[E, ...]``)
and whose forward is ``experts(hidden [N, H], top_k_index [N, k],
top_k_weights [N, k]) -> [N, H]``: each token's sum over its k experts of
the routing weight times the expert's output. The router, top-k, weight
normalisation, shared experts and auxiliary losses are outside it, in the
block, and stay exactly as the model defines them. :func:`find_experts`
finds such modules by that contract (an integer ``num_experts``, every
parameter's leading size equal to it, a three-argument forward), not by
family.

[Note: dispatch and combine]
:func:`shard_experts` keeps on rank r of the group (size ep) the experts
``[r E/ep, (r+1) E/ep)`` (new parameters holding those rows; the module's
``num_experts`` becomes E/ep, as ``shard_model`` divides head counts) and
wraps the module's call with a forward pre-hook and a forward hook:

- dispatch: each (token, choice) pair goes to the rank holding its expert,
  sorted by expert; the rows per expert are exchanged (each rank learns how
  many rows of each of its experts every rank sends, which also gives the
  received rows' local expert indices), then the hidden rows and the
  routing weights by a differentiable all-to-all (uneven splits);
- the module's own forward then runs on the rows it received, one choice
  each (``top_k_index [M, 1]``), so its computation (eager loop, grouped
  matrix multiply, biases, activations) is the model's;
- combine: the weighted rows go back by the reverse all-to-all and are
  summed per token.

No token is dropped (dropless); with ``capacity_factor`` a rank computes at
most ``ceil(factor * tokens * k / E)`` rows per expert, dropping the rest
in routing order as GShard does (their contribution is zero).

[Note: expert gradients]
An expert's gradient on its rank sums the contributions of every rank of
its expert-parallel group (the combine's backward brings them). Data
parallelism averages each dense gradient over the world W; for the
experts the same mean is the sum over the group divided by W, that is the
mean over the expert-data-parallel group (the ranks holding the same
experts, W/ep of them) of the gradient divided by ep. So each expert shard
carries a gradient hook dividing by ep, and the plugin averages expert
gradients over :func:`expert_data_group` and dense ones over the world.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pc_comm import AllToAll, ShmCommunicator, on_one_host

__all__ = [
    "ExpertShard",
    "expert_parameters",
    "expert_shard",
    "find_experts",
    "is_expert_parameter",
    "shard_experts",
]


@dataclass(frozen=True)
class ExpertShard:
    """What :func:`shard_experts` did to one experts module: its group, the
    global expert count and the first global expert this rank holds."""

    group: dist.ProcessGroup
    size: int
    num_experts: int
    first: int
    local: int
    capacity_factor: float | None
    names: tuple[str, ...]
    #: pc-comm's shared-memory all-to-all over ``group`` when its ranks are
    #: on one host and the experts on the CPU; None: torch.distributed's
    transport: AllToAll | None = None


_SHARDS: weakref.WeakKeyDictionary[nn.Module, ExpertShard] = weakref.WeakKeyDictionary()
# Tensors compare element-wise: the shards are keyed by identity.
_EXPERT_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _forward_arity(module: nn.Module) -> int:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def _fits(module: nn.Module) -> bool | str:
    """True when ``module`` holds experts by the contract; a reason when it
    takes the experts' call but holds other parameters; False otherwise
    (a router also counts the experts, and takes hidden states only)."""
    count = getattr(module, "num_experts", None)
    params = list(module.named_parameters())
    if type(count) is not int or count < 1 or not params or _forward_arity(module) != 3:
        return False
    odd = [n for n, p in params if p.dim() == 0 or p.shape[0] != count]
    if odd:
        return (
            f"{type(module).__name__} holds parameters without one leading entry per expert "
            f"({', '.join(odd[:3])}; num_experts={count})"
        )
    return True


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` [Note: the experts contract], by
    path (already sharded ones included). Raises ValueError naming a module
    that takes the experts' call but does not hold them packed; returns []
    for a model without experts."""
    found = []
    for path, module in model.named_modules():
        if module in _SHARDS:
            found.append((path, module))
            continue
        fits = _fits(module)
        if isinstance(fits, str):
            raise ValueError(
                f"{type(model).__name__}: pc's expert parallelism splits experts modules that "
                "hold every expert's weights packed, one leading entry per expert, with "
                f"forward(hidden_states, top_k_index, top_k_weights); but {path}: {fits}. Fix: "
                "train this model without expert parallelism (ep=1: data parallelism, ZeRO, a "
                "pipeline)."
            )
        if fits:
            found.append((path, module))
    return found


def expert_shard(module: nn.Module) -> ExpertShard | None:
    """What :func:`shard_experts` did to ``module``, or None."""
    return _SHARDS.get(module)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert shard made by :func:`shard_experts`."""
    return isinstance(param, nn.Parameter) and param in _EXPERT_PARAMS


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s expert shards, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if is_expert_parameter(p)]


def shard_experts(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    capacity_factor: float | None = None,
) -> list[str]:
    """Split the experts of every MoE block of ``model`` over ``group``
    (default: the world) [Note: dispatch and combine]; returns the experts
    modules' paths. ep must divide every block's expert count. The model
    must be the same on every rank of the group (same seed or weights)."""
    group = group or dist.group.WORLD
    assert group is not None
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
    found = [(p, m) for p, m in find_experts(model) if m not in _SHARDS]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no experts module (an integer num_experts and packed "
            "expert weights with forward(hidden_states, top_k_index, top_k_weights)); expert "
            "parallelism needs a mixture-of-experts model."
        )
    for path, module in found:
        count = int(module.num_experts)  # type: ignore[arg-type]
        if count % size:
            raise ValueError(
                f"{path} has {count} experts, which the expert-parallel size {size} does not "
                f"divide; use an ep size among {[d for d in range(1, count + 1) if not count % d]}."
            )
    transport = _transport(group, found[0][1])
    for _, module in found:
        _shard_one(module, group, size, rank, capacity_factor, transport)
    return [p for p, _ in found]


def _transport(group: dist.ProcessGroup, module: nn.Module) -> AllToAll | None:
    """Collective: the shared-memory all-to-all for host-resident experts
    whose group is on one host [Note: dispatch and combine]."""
    first = next(module.parameters(), None)
    on_host = first is not None and first.device.type == "cpu"
    if dist.get_world_size(group) == 1 or not on_host or not on_one_host(group):
        return None
    return ShmCommunicator(group, slot_bytes=_SLOT_BYTES)


# Bytes a rank writes per round of the shared-memory exchange: a few
# thousand hidden rows of a small model, a few hundred of a large one.
_SLOT_BYTES = 4 * 1024 * 1024


def _shard_one(
    module: nn.Module,
    group: dist.ProcessGroup,
    size: int,
    rank: int,
    capacity_factor: float | None,
    transport: AllToAll | None = None,
) -> None:
    count = int(module.num_experts)  # type: ignore[arg-type]
    local = count // size
    first = rank * local
    names, shards = [], []
    for name, param in list(module.named_parameters()):
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        shard = nn.Parameter(
            param.detach()[first : first + local].clone(), requires_grad=param.requires_grad
        )
        if shard.requires_grad and size > 1:
            shard.register_hook(lambda g, s=size: g / s)  # type: ignore[no-untyped-call]  # [Note: expert gradients]
        setattr(owner, leaf, shard)
        names.append(name)
        shards.append(shard)
    setattr(module, "num_experts", local)  # noqa: B010 (as shard_model divides head counts)
    info = ExpertShard(group, size, count, first, local, capacity_factor, tuple(names), transport)
    _SHARDS[module] = info
    for shard in shards:
        _EXPERT_PARAMS[shard] = info
    plans: list[_Route] = []
    module.register_forward_pre_hook(
        lambda m, args, kwargs: _dispatch(info, plans, args, kwargs), with_kwargs=True
    )
    module.register_forward_hook(lambda m, args, out: _combine(info, plans, out))


# -- the exchange -------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """A differentiable all-to-all of rows with uneven splits: backward
    sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], info: ExpertShard
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.info = send, recv, info
        return _exchange(rows, send, recv, info)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.info), None, None, None


def _move(rows: torch.Tensor, send: list[int], recv: list[int], info: ExpertShard) -> torch.Tensor:
    """Rows sent by ``send`` counts and received by ``recv`` counts, with
    gradients flowing back."""
    out: torch.Tensor = _AllToAll.apply(rows, send, recv, info)  # type: ignore[no-untyped-call, unused-ignore]
    return out


def _exchange(
    rows: torch.Tensor, send: list[int], recv: list[int], info: ExpertShard
) -> torch.Tensor:
    """``send[r]`` rows to rank r, ``recv[r]`` from it, through the
    group's shared-memory all-to-all where it has one."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    if info.transport is not None:
        info.transport.all_to_all(list(torch.split(out, recv)), list(torch.split(rows, send)))
    else:
        dist.all_to_all_single(out, rows, recv, send, group=info.group)
    return out


@dataclass
class _Route:
    """One call's routing: where each sent row came from, and the splits."""

    tokens: torch.Tensor  # [S] the token of each sent row
    send: list[int]
    recv: list[int]
    shape: tuple[int, ...]  # the hidden states' shape as given
    dtype: torch.dtype


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    values = list(args)
    for name in ("hidden_states", "top_k_index", "top_k_weights"):
        if len(values) < 3 and name in kwargs:
            values.append(kwargs[name])
    if len(values) != 3:
        raise TypeError(
            "an expert-parallel experts module takes (hidden_states, top_k_index, "
            f"top_k_weights); got {len(args)} positional and {sorted(kwargs)} keyword arguments."
        )
    return values


def _dispatch(
    info: ExpertShard, plans: list[_Route], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    hidden, index, weights = _arguments(args, kwargs)
    shape = tuple(hidden.shape)
    hidden = hidden.reshape(-1, shape[-1])
    choices = index.reshape(hidden.shape[0], -1)
    k = choices.shape[1]
    experts = choices.reshape(-1)
    tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    order = torch.argsort(experts, stable=True)
    if info.capacity_factor is not None:
        order = _within_capacity(order, experts, info, hidden.shape[0] * k)
    experts, tokens = experts[order], tokens[order]
    # Rows per expert: chunk r (rank r's experts) goes to rank r, which
    # receives, from every rank, its rows per local expert, in that order.
    sent = torch.bincount(experts, minlength=info.num_experts)
    received = _exchange(sent.view(info.size, info.local), [1] * info.size, [1] * info.size, info)
    received = received.reshape(-1)
    send = sent.view(info.size, info.local).sum(1).tolist()
    recv = received.view(info.size, info.local).sum(1).tolist()
    rows = _move(hidden[tokens], send, recv, info)
    routed = _move(weights.reshape(-1)[order], send, recv, info)
    ids = torch.arange(info.local, device=received.device).repeat(info.size)
    local = ids.repeat_interleave(received)
    plans.append(_Route(tokens, send, recv, shape, hidden.dtype))
    return (rows, local[:, None], routed[:, None]), {}


def _within_capacity(
    order: torch.Tensor, experts: torch.Tensor, info: ExpertShard, pairs: int
) -> torch.Tensor:
    """The (token, choice) pairs each expert keeps: at most ``capacity``
    per expert, first come first served in token order."""
    assert info.capacity_factor is not None
    capacity = math.ceil(info.capacity_factor * pairs / info.num_experts)
    sorted_experts = experts[order]
    starts = torch.searchsorted(sorted_experts, sorted_experts, right=False)
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts
    return order[rank_in_expert < capacity]


def _combine(info: ExpertShard, plans: list[_Route], out: torch.Tensor) -> torch.Tensor:
    route = plans.pop()
    back = _move(out, route.recv, route.send, info)
    total = back.new_zeros((math.prod(route.shape[:-1]), route.shape[-1]))
    total = total.index_add(0, route.tokens, back)
    return total.reshape(route.shape).to(route.dtype)
