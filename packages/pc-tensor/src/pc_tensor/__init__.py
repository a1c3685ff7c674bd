"""Tensor and sequence parallelism with policies for Hugging Face models.

Status: in progress (issue 9). The parallel layers and their collectives
exist; sequence parallelism, the model policies and ``shard_model`` do not
yet.
"""

from pc_tensor.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
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
    "reduce_from_tp",
    "split_to_tp",
    "vocab_parallel_cross_entropy",
]
