"""``colossalai.shardformer``: ``ShardConfig``, ``ShardFormer`` and the
gradient-checkpoint configs, over pc-tensor's ``shard_model``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = [
    "GradientCheckpointConfig",
    "PipelineGradientCheckpointConfig",
    "ShardConfig",
    "ShardFormer",
    "checkpoint_fraction",
]


@dataclass
class GradientCheckpointConfig:
    """Recompute a share of the transformer blocks in backward. Given to
    ``HybridParallelPlugin``, it is pc's per-block recomputation of that
    share (:func:`checkpoint_fraction`); given to ``ShardFormer``, a ratio
    above 0 recomputes every block through the model's own
    ``gradient_checkpointing_enable()``: the same losses and gradients as
    any ratio (recomputation changes no value), more recompute time than a
    ratio below 1 would spend."""

    gradient_checkpointing_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gradient_checkpointing_ratio <= 1.0:
            raise ValueError(
                "gradient_checkpointing_ratio must be in [0, 1], got "
                f"{self.gradient_checkpointing_ratio}."
            )

    @property
    def enabled(self) -> bool:
        return self.gradient_checkpointing_ratio > 0


@dataclass
class PipelineGradientCheckpointConfig(GradientCheckpointConfig):
    """Per pipeline stage: ``num_ckpt_layers_per_stage`` blocks recomputed
    on each (pc: every block, as for a ratio above 0)."""

    num_stages: int | None = None
    num_model_chunks: int | None = None
    num_model_layers: int | None = None
    num_ckpt_layers_per_stage: list[int] | None = None

    @property
    def enabled(self) -> bool:
        layers = self.num_ckpt_layers_per_stage
        return super().enabled or (layers is not None and sum(layers) > 0)


@dataclass
class ShardConfig:
    """Colossal-AI's ``ShardConfig``: which parallelism ``ShardFormer``
    applies. pc honours ``tensor_parallel_process_group`` and
    ``enable_tensor_parallelism`` (pc-tensor's ``shard_model``, from the
    model's tensor-parallel plan) and ``gradient_checkpoint_config``; the
    kernel switches (``enable_fused_normalization``, ``enable_flash_attention``,
    ``enable_jit_fused``, ``enable_all_optimization``) select implementations
    that compute the same values and have no effect. Sequence parallelism,
    pipelines and experts go through ``HybridParallelPlugin`` /
    ``pc_tensor``; asking for them here is refused with that advice."""

    tensor_parallel_process_group: Any = None
    sequence_parallel_process_group: Any = None
    pipeline_stage_manager: Any = None
    enable_tensor_parallelism: bool = True
    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    gradient_checkpoint_config: GradientCheckpointConfig | None = None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    sp_axis: int | None = None
    pg_mesh: Any = None
    inner_ring_size: int | None = None
    moe_dp_group: Any = None
    ep_group: Any = None
    fp8_communication: bool = False

    def __post_init__(self) -> None:
        refused = {
            "enable_sequence_parallelism": self.enable_sequence_parallelism,
            "pipeline_stage_manager": self.pipeline_stage_manager is not None,
            "sequence_parallel_process_group": self.sequence_parallel_process_group is not None,
            "ep_group": self.ep_group is not None,
            "fp8_communication": self.fp8_communication,
        }
        asked = [name for name, given in refused.items() if given]
        if asked:
            raise ValueError(
                f"ShardConfig({', '.join(asked)}): pc's ShardFormer applies tensor parallelism "
                "only; sequence parallelism and pipelines go through "
                "pc_compat.colossalai.booster.plugin.HybridParallelPlugin (sp_size=, pp_size=), "
                "experts through expert parallelism (not built yet), and pc communicates in "
                "the parameters' dtype (no fp8)."
            )
        if not self.parallel_output:
            raise ValueError(
                "ShardConfig(parallel_output=False): ShardFormer returns the model with its "
                "logits split over the vocabulary; gather them with pc_tensor.gather_logits, "
                "or use HybridParallelPlugin(parallel_output=False)."
            )


class ShardFormer:
    """``ShardFormer(shard_config).optimize(model)`` shards ``model`` in
    place over the config's tensor-parallel group (default: every rank)
    and returns ``(model, shared_params)``; ``shared_params`` is empty: pc
    keeps a tied embedding and head as one split parameter."""

    def __init__(self, shard_config: ShardConfig) -> None:
        # What to apply.
        self.shard_config = shard_config

    def optimize(self, model: nn.Module, policy: Any = None) -> tuple[nn.Module, list[Any]]:
        from pc_tensor import shard_model

        if policy is not None:
            raise ValueError(
                "ShardFormer.optimize(policy=...): Colossal-AI policy objects have no pc "
                "counterpart; pc shards from the model's own tensor-parallel plan (or pass a "
                "pc_tensor.Policy to pc_tensor.shard_model)."
            )
        config = self.shard_config
        if config.enable_tensor_parallelism:
            group = config.tensor_parallel_process_group or dist.group.WORLD
            shard_model(model, group)
        checkpoint = config.gradient_checkpoint_config
        if checkpoint is not None and checkpoint.enabled:
            enable_recomputation(model)
        return model, []


def checkpoint_fraction(config: GradientCheckpointConfig) -> float:
    """The share of the blocks ``config`` recomputes: its ratio, or a
    pipeline config's ``num_ckpt_layers_per_stage`` summed over
    ``num_model_layers`` (every block when the total is unknown)."""
    layers = getattr(config, "num_ckpt_layers_per_stage", None)
    total = getattr(config, "num_model_layers", None)
    if layers is not None and sum(layers) > 0:
        return min(1.0, sum(layers) / total) if total else 1.0
    return config.gradient_checkpointing_ratio


def enable_recomputation(model: nn.Module) -> None:
    """Recompute every transformer block in backward (the model's own
    ``gradient_checkpointing_enable``), or say why not."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"gradient_checkpoint_config: {type(model).__name__} has no "
            "gradient_checkpointing_enable(); wrap its blocks in torch.utils.checkpoint "
            "yourself, or leave the config out."
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
