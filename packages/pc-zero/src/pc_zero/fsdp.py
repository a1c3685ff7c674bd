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
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pc_chunk import ChunkManager, StaticPlacement
from pc_comm import Communicator
from pc_offload import CopyEngine, PinnedPool
from pc_zero.sharded import MixedPrecision, ShardedModule, prepare_module

__all__ = [
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


WrapPolicy = ModuleSizePolicy | TransformerBlockPolicy


def size_based_auto_wrap_policy(min_num_params: int = 100_000_000) -> ModuleSizePolicy:
    return ModuleSizePolicy(min_num_params)


def transformer_auto_wrap_policy(
    transformer_layer_cls: Collection[type[nn.Module]],
) -> TransformerBlockPolicy:
    return TransformerBlockPolicy(frozenset(transformer_layer_cls))


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
    ([Note: stepping in backward] in pc_zero.gemini)."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        auto_wrap_policy: WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        offload_params: bool = False,
        device: torch.device | str | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = True,
        comm: Communicator | None = None,
        step_in_backward: bool = False,
    ) -> None:
        mp = mixed_precision
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
        units = find_units(module, auto_wrap_policy)
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
