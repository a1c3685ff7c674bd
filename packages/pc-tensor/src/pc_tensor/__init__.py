"""Tensor and sequence parallelism with policies for Hugging Face models.

Status: in progress (issue 9). The parallel layers, their collectives and
sequence parallelism exist; the model policies and ``shard_model`` do not
yet.
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
from pc_tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "gather_sequence",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "split_to_tp",
    "sync_replicated_grads",
    "vocab_parallel_cross_entropy",
]
