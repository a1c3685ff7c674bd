"""Tensor parallelism under pipeline parallelism: the stages' balance, the
other stages' layers kept without memory, and the tensor-parallel split
of the model before the stages are cut (the hybrid plugin's
:func:`~pc_booster.plugins.hybrid_pipeline.configure_pipeline`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pc_booster.pipeline import pipeline_layers
from pc_booster.plugins.common import broadcast_module, device, has_lazy, materializer

if TYPE_CHECKING:
    from pc_booster.plugins.hybrid import HybridParallelPlugin

__all__ = ["other_stages_to_meta", "shard_tensor_parallel", "stage_balance"]


def stage_balance(plugin: HybridParallelPlugin, layers: int) -> list[int]:
    """Layers per stage: the blocks split evenly (or as the user says), the
    embedding on the first stage and the head on the last."""
    o = plugin.options
    stages = o.pp_size * o.chunks_per_rank()
    blocks = layers - 2
    counts = o.num_layers_per_stage
    balance = list(counts) if counts is not None else [blocks // stages] * stages
    balance[0] += 1  # the embedding
    balance[-1] += 1  # the head
    return balance


# [Note: only this stage is materialised under tensor parallelism]
# Tensor parallelism shards the whole model before the stages are cut (its
# plan names the model's paths), materialising each lazily built layer as
# it splits it. Every layer of every stage was therefore materialised, and
# kept: the user's model object still holds the other stages' layers, so a
# rank of a tp x pp job held 1/tp of the whole model (measured: one extra
# copy of the MLP weights of the other stage at tp 2 x pp 2). Now the
# stages are found first, and the other stages' lazy tensors become meta
# tensors (their shapes, no memory) before the split, which then splits
# them on the meta device too; only this stage's layers hold values.


def other_stages_to_meta(plugin: HybridParallelPlugin, model: nn.Module) -> None:
    """The lazy parameters and buffers of every stage but this rank's, as
    meta tensors [Note: only this stage is materialised under tensor
    parallelism]."""
    from pc_chunk import is_lazy, materialize_
    from pc_pipeline import Sequential, partition

    o = plugin.options
    layers, _ = pipeline_layers(model, None)
    sequence, balance = Sequential(*layers), stage_balance(plugin, len(layers))

    def tensors(rank: int) -> list[torch.Tensor]:
        part = partition(sequence, rank, o.pp_size, o.chunks_per_rank(), balance=balance)
        stages = part if isinstance(part, list) else [part]
        return [t for s in stages for t in [*s.parameters(), *s.buffers()]]

    mine = {id(t) for t in tensors(plugin.layout.coord.pp)}
    for rank in range(o.pp_size):
        if rank == plugin.layout.coord.pp:
            continue
        for tensor in tensors(rank):
            if id(tensor) not in mine and is_lazy(tensor):
                materialize_(tensor, torch.device("meta"))


def _to_device_but_meta(model: nn.Module) -> None:
    """``model``'s parameters and buffers on the device, but for the meta
    tensors of the other stages."""
    to = device()
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and not param.is_meta and param.device != to:
                param.data = param.data.to(to)
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != to:
                module._buffers[name] = buffer.to(to)


def shard_tensor_parallel(plugin: HybridParallelPlugin, model: nn.Module) -> None:
    """Tensor parallelism shards the whole model (replacing its layers), and
    the stages are cut after: a lazily built model is materialised layer by
    layer as each is split (every rank replays the same values), an eager
    one broadcast first."""
    from pc_tensor import shard_model

    group = plugin.layout.tp_group
    policy = plugin.tp_policy(model)  # under ep: the family's plan without its experts
    if has_lazy(model):
        materialize = materializer(device())
        shard_model(model, group, policy, sequence_parallel=False, materialize=materialize)
        _to_device_but_meta(model)
    else:
        model.to(device())
        broadcast_module(model)
        shard_model(model, group, policy, sequence_parallel=False)
