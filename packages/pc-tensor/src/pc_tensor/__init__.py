"""Tensor and sequence parallelism with policies for Hugging Face models.

``shard_model(model, tp_group)`` shards a ``transformers`` model in place:
any family whose config carries transformers' tensor-parallel plan
(``base_model_tp_plan``), GPT-2, BERT, OPT and Bloom from pc's own
policies, and other families from a plan inferred from their module tree
(:func:`infer_plan`: ViT, CLIP's vision tower, RoBERTa ...). Attention heads
and MLPs are split Megatron-style, the vocabulary split with a loss that
never gathers the logits, optional sequence parallelism; :class:`Policy`
describes another model family.
"""

from pc_tensor.comm import (
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_to_tp,
    sync_replicated_grads,
)
from pc_tensor.experts import (
    ExpertShard,
    expert_parameters,
    expert_shard,
    find_experts,
    is_expert_parameter,
    shard_experts,
)
from pc_tensor.inferred import infer_plan, policy_or_inferred
from pc_tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from pc_tensor.plans import has_plan, plan_policy, policy_for
from pc_tensor.policies import POLICIES, Policy
from pc_tensor.ring import ring_model
from pc_tensor.sequence import (
    sequence_group,
    sequence_lm_loss,
    sequence_positions,
    sync_sequence_grads,
)
from pc_tensor.sequence_modes import sequence_attention
from pc_tensor.shard import (
    ShardInfo,
    full_state_dict,
    gather_logits,
    load_full_state_dict,
    shard_info,
    shard_model,
)
from pc_tensor.specs import ShardSpec, full_shape, place_local_box, shard_tensor, unshard_tensor
from pc_tensor.ulysses import heads_to_sequence, sequence_to_heads, ulysses_model

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "ColumnParallelLinear",
    "ExpertShard",
    "Policy",
    "RowParallelLinear",
    "ShardInfo",
    "ShardSpec",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "expert_parameters",
    "expert_shard",
    "find_experts",
    "full_shape",
    "full_state_dict",
    "gather_from_tp",
    "gather_logits",
    "gather_sequence",
    "has_plan",
    "heads_to_sequence",
    "infer_plan",
    "is_expert_parameter",
    "load_full_state_dict",
    "place_local_box",
    "plan_policy",
    "policy_for",
    "policy_or_inferred",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "ring_model",
    "sequence_attention",
    "sequence_group",
    "sequence_lm_loss",
    "sequence_positions",
    "sequence_to_heads",
    "shard_experts",
    "shard_info",
    "shard_model",
    "shard_tensor",
    "split_to_tp",
    "sync_replicated_grads",
    "sync_sequence_grads",
    "ulysses_model",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
]
