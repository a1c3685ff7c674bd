"""What pc-estimate needs to know of a model's shape (:class:`ModelShape`),
in a module of its own so that the cost model's parts (activations, step
time) read it without importing the cost model: :func:`pc_train.cost.model_shape`
measures it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pc_train.options import PluginKind, PluginOptions

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model, measured on a meta-device copy."""

    params: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    tp_sharded: int  # parameters tensor parallelism splits across ranks
    stage_params: tuple[int, ...]  # parameters of each of `layers` blocks
    embed_params: int  # first pipeline stage's extra parameters
    head_params: int  # last stage's (a tied head counts again)
    expert_params: int = 0  # mixture-of-experts blocks' experts (expert parallelism splits them)
    moe_layers: int = 0  # blocks whose MLP is a mixture of experts
    top_k: int = 0  # experts each token is routed to
    expert_ffn: int = 0  # one expert's intermediate width
    kv_heads: int = 0  # key/value heads (grouped-query attention; 0: as many as heads)
    experts: int = 0  # experts in each mixture-of-experts block

    def experts_per_rank(self, options: PluginOptions) -> int:
        """Expert parameters one rank holds: its stage's share, 1/ep of them."""
        stage = self.expert_params
        if options.pp > 1:  # the experts spread over the blocks like the rest
            stage = round(self.expert_params * self._stage_total(options) / self.params)
        return math.ceil(stage / options.ep)

    def _stage_total(self, options: PluginOptions) -> int:
        # The blocks of each stage (``--layers-per-stage``, else
        # PluginOptions.stage_blocks' split): the busiest stage's parameters.
        blocks, start = [], 0
        for count in options.stage_blocks(self.layers):
            blocks.append(sum(self.stage_params[start : start + count]))
            start += count
        blocks[0] += self.embed_params
        blocks[-1] += self.head_params
        if options.model_chunks > 1:  # interleaved: rank i holds stages i and i + pp
            blocks = [blocks[i] + blocks[i + options.pp] for i in range(options.pp)]
        return max(blocks)

    def per_rank(self, options: PluginOptions) -> int:
        """Parameters one rank's model part holds (its experts included)."""
        if options.pp > 1:
            total = self._stage_total(options)
            sharded = round(self.tp_sharded * total / self.params)
        else:
            total, sharded = self.params, self.tp_sharded
        if options.ep > 1:  # pc's expert parallelism: no tensor parallelism with it
            stage_experts = self.experts_per_rank(options) * options.ep
            return total - stage_experts + self.experts_per_rank(options)
        if options.kind is PluginKind.FSDP:  # torch's styles split the blocks' projections only
            sharded = max(0, sharded - self.embed_params - self.head_params)
        return total - sharded + math.ceil(sharded / options.tp)
