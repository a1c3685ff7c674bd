"""ZeRO-3 by wrapped units: :class:`FullyShardedDataParallel`.

[Note: units]
An auto-wrap policy picks the modules that become units (each transformer
block, or every module holding at least ``min_num_params`` parameters not
already in a smaller unit); the root module is the last unit and takes
what is left. Each unit's parameters become one flat chunk, sharded evenly
over the ranks ([Note: units] in pc_chunk.manager). Before a unit's forward
its chunk is all-gathered and, while it computes, the next unit's gather is
already running (the order is recorded in the first step); after it, the
chunk is released (``reshard_after_forward=True``) or kept for backward
(``False``, ZeRO-2-like: more memory, one gather less). In backward the
chunk is gathered again (the previous unit's prefetched), and once every
gradient of the unit has arrived they are reduce-scattered (averaged, in
``reduce_dtype``) into this rank's gradient shard. Parameters and gradients
between steps are shards [Note: ZeRO-3 parameters].

[Note: wrap policies]
``auto_wrap_policy`` takes pc's frozen policies (:class:`ModuleSizePolicy`,
:class:`TransformerBlockPolicy`, or ``size_based_auto_wrap_policy(n)`` /
``transformer_auto_wrap_policy({Block})`` that build them, also as a
``functools.partial`` of those two), or any torch-style callable
``policy(module=, recurse=, nonwrapped_numel=) -> bool``, such as
``functools.partial(torch.distributed.fsdp.wrap.size_based_auto_wrap_policy,
min_num_params=n)``. A torch-style callable is asked as torch asks it: with
``recurse=True`` before a module's children (False: the subtree is one
leaf, nothing inside it becomes a unit) and with ``recurse=False`` after
them, with the parameters no unit below took.

[Note: prefetch flags]
The chunk manager has one prefetch switch, read whenever a chunk is
gathered; the wrapper sets it to ``forward_prefetch`` when the root forward
starts and to whether ``backward_prefetch`` is set when it returns, so each
pass follows its own flag (recomputation under activation checkpointing
runs in backward and follows backward's). In backward, pc starts the next
unit's all-gather when the current unit's backward begins, before its
gradients are computed: torch's ``BACKWARD_PRE``. pc has no later point to
issue it, so ``BACKWARD_POST`` runs the same way (the same two units'
parameters gathered at most, as ``BACKWARD_PRE`` in torch); ``None``
gathers each unit only when its backward needs it.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_chunk import ChunkManager, StaticPlacement
from pc_comm import Communicator
from pc_offload import CopyEngine, PinnedPool
from pc_zero.sharded import MixedPrecision, ShardedModule, prepare_module

__all__ = [
    "BackwardPrefetch",
    "CallablePolicy",
    "FullyShardedDataParallel",
    "ModuleSizePolicy",
    "TransformerBlockPolicy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]


@dataclass(frozen=True)
class ModuleSizePolicy:
    """Wrap a module when it holds at least ``min_num_params`` parameters
    that no smaller unit took."""

    min_num_params: int = 100_000_000

    def __post_init__(self) -> None:
        if self.min_num_params < 1:
            raise ValueError(f"min_num_params must be at least 1, got {self.min_num_params}.")

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_num_params


@dataclass(frozen=True)
class TransformerBlockPolicy:
    """Wrap every instance of the given block classes."""

    block_classes: frozenset[type[nn.Module]]

    def __post_init__(self) -> None:
        bad = [c for c in self.block_classes if not isinstance(c, type)]
        if not self.block_classes or bad:
            raise ValueError(
                f"TransformerBlockPolicy needs module classes (e.g. {{GPT2Block}}); got "
                f"{set(self.block_classes)!r}."
            )

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return isinstance(module, tuple(self.block_classes))


@dataclass(frozen=True)
class CallablePolicy:
    """A torch-style wrap policy [Note: wrap policies]:
    ``fn(module=, recurse=, nonwrapped_numel=) -> bool``."""

    fn: Callable[..., Any]

    def should_wrap(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return bool(self.fn(module=module, recurse=False, nonwrapped_numel=unwrapped_numel))

    def should_recurse(self, module: nn.Module, numel: int) -> bool:
        return bool(self.fn(module=module, recurse=True, nonwrapped_numel=numel))


WrapPolicy = ModuleSizePolicy | TransformerBlockPolicy | CallablePolicy


class BackwardPrefetch(enum.Enum):
    """When backward starts gathering the next unit [Note: prefetch flags]:
    torch's names. pc runs both at ``BACKWARD_PRE``'s point."""

    BACKWARD_PRE = "backward_pre"  # when the current unit's backward begins
    BACKWARD_POST = "backward_post"  # torch: after its gradients; pc: as BACKWARD_PRE


def parse_backward_prefetch(value: object) -> BackwardPrefetch | None:
    """pc's or torch's ``BackwardPrefetch`` member, or None."""
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, enum.Enum) and value.name in BackwardPrefetch.__members__:
        return BackwardPrefetch[value.name]  # torch.distributed.fsdp.BackwardPrefetch
    raise ValueError(
        "backward_prefetch must be BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch."
        f"BACKWARD_POST or None, got {value!r}."
    )


def size_based_auto_wrap_policy(min_num_params: int = 100_000_000) -> ModuleSizePolicy:
    return ModuleSizePolicy(min_num_params)


def transformer_auto_wrap_policy(
    transformer_layer_cls: Collection[type[nn.Module]],
) -> TransformerBlockPolicy:
    return TransformerBlockPolicy(frozenset(transformer_layer_cls))


_FACTORIES: tuple[Callable[..., WrapPolicy], ...] = (
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)


def resolve_wrap_policy(policy: object) -> WrapPolicy | None:
    """``auto_wrap_policy`` as users pass it [Note: wrap policies]."""
    if policy is None or isinstance(policy, (ModuleSizePolicy, TransformerBlockPolicy)):
        return policy
    if isinstance(policy, CallablePolicy):
        return policy
    if isinstance(policy, functools.partial) and policy.func in _FACTORIES:
        built: WrapPolicy = policy()  # pc's own factory: its policy object
        return built
    if policy in _FACTORIES:
        raise TypeError(
            "auto_wrap_policy got the factory itself; call it, e.g. "
            "size_based_auto_wrap_policy(min_num_params=1_000_000), or pass "
            "functools.partial(size_based_auto_wrap_policy, min_num_params=1_000_000)."
        )
    if callable(policy):
        return CallablePolicy(policy)
    raise TypeError(
        "auto_wrap_policy must be a ModuleSizePolicy, a TransformerBlockPolicy, a torch-style "
        "callable policy(module=, recurse=, nonwrapped_numel=) -> bool (e.g. functools.partial("
        f"size_based_auto_wrap_policy, min_num_params=...)) or None; got {policy!r}."
    )


def find_units(
    root: nn.Module, policy: WrapPolicy | None
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """[Note: units]: (module, its parameters) in post-order, root last. A
    parameter shared by two modules belongs to the first unit that holds it."""
    taken: set[nn.Parameter] = set()
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []

    def free_params(module: nn.Module) -> list[nn.Parameter]:
        found: dict[nn.Parameter, None] = {}
        for param in module.parameters():
            if param not in taken:
                found.setdefault(param, None)
        return list(found)

    def visit(module: nn.Module) -> None:
        # Only a torch-style callable can stop the descent [Note: wrap policies].
        if not isinstance(policy, CallablePolicy) or policy.should_recurse(
            module, sum(p.numel() for p in free_params(module))
        ):
            for child in module.children():
                visit(child)
        if module is root or policy is None:
            return
        params = free_params(module)
        if params and policy.should_wrap(module, sum(p.numel() for p in params)):
            taken.update(params)
            units.append((module, params))

    visit(root)
    units.append((root, free_params(root)))
    return units


class FullyShardedDataParallel(ShardedModule):
    """ZeRO-3 [Note: units]. ``process_group`` (or a ``comm``) is the data-
    parallel group; parameters must be the same on every rank (same seed,
    or ``sync_module_states=True`` to copy rank 0's). ``offload_params``
    keeps the shards (and so the optimizer step) on the host, gathered
    through pinned memory. Build the optimizer afterwards, over
    ``model.parameters()``. ``step_in_backward`` steps each unit as soon as
    its gradients are reduced, through a :class:`~pc_zero.GeminiOptimizer`
    ([Note: stepping in backward] in pc_zero.gemini). ``auto_wrap_policy``:
    [Note: wrap policies]; ``forward_prefetch`` and ``backward_prefetch``:
    [Note: prefetch flags]."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        auto_wrap_policy: WrapPolicy | Callable[..., Any] | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        offload_params: bool = False,
        device: torch.device | str | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = True,
        comm: Communicator | None = None,
        step_in_backward: bool = False,
        backward_prefetch: BackwardPrefetch | enum.Enum | None = BackwardPrefetch.BACKWARD_PRE,
    ) -> None:
        mp = mixed_precision
        policy = resolve_wrap_policy(auto_wrap_policy)
        prefetch_backward = parse_backward_prefetch(backward_prefetch)
        # [Note: build dtype] in pc_zero.sharded: without a param_dtype the
        # compute dtype is the masters' (fp32), whatever the model was built in.
        compute = mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32
        comm, device, init_param = prepare_module(
            module,
            "FullyShardedDataParallel",
            comm,
            process_group,
            device,
            sync_module_states,
            compute,
        )
        units = find_units(module, policy)
        manager = ChunkManager(
            module,
            units=units,
            comm=comm,
            device=device,
            placement=StaticPlacement(0.0 if offload_params else 1.0),
            reduce_dtype=mp.reduce_dtype if mp is not None else torch.float32,
            engine=CopyEngine(PinnedPool()) if offload_params and device.type == "cuda" else None,
            compute_dtype=compute,
            expose_shards=True,
            reshard_after_forward=reshard_after_forward,
            prefetch=forward_prefetch,
            init_param=init_param,
        )
        super().__init__(module, manager, comm, mixed_precision, step_in_backward=step_in_backward)
        self.units = [unit for unit, _ in units]
        # [Note: prefetch flags]: the manager's one switch, set per pass.
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = prefetch_backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.manager.prefetch = self.forward_prefetch  # [Note: prefetch flags]
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.manager.prefetch = self.backward_prefetch is not None
