"""pc-zero: ZeRO-1/2 (`LowLevelZeroOptimizer`), ZeRO-3 by wrapped units
(`FullyShardedDataParallel`) and by chunks (`GeminiDDP`)."""

from pc_zero.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from pc_zero.fsdp import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    ModuleSizePolicy,
    TransformerBlockPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from pc_zero.gemini import GeminiDDP, GeminiOptimizer, PlacementPolicy
from pc_zero.gemini_search import searched_chunk_size
from pc_zero.layout import Bucket, Slot, plan_buckets
from pc_zero.loss_scale import (
    DynamicLossScaler,
    LossScaleConfig,
    NonFiniteGradientError,
    counts_under_tensor_parallel,
    unscale_clip_and_check,
)
from pc_zero.low_level_zero import LowLevelZeroOptimizer
from pc_zero.memory import ModelStateMemory, zero_paper_bytes
from pc_zero.pieces import Box, Pieces, PiecesLoadPlanner, PiecesSavePlanner, flat_range_boxes
from pc_zero.protocols import OwnedPiece, ShardedOptimizer
from pc_zero.safe_load import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    named_dcp_failures,
    read_metadata,
    refuse_weights_only,
    safe_load_bytes,
)
from pc_zero.sharded import MixedPrecision, ShardedModule
from pc_zero.state import merge_sharded_state_dicts
from pc_zero.together import step_together

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "Box",
    "Bucket",
    "DynamicLossScaler",
    "FullyShardedDataParallel",
    "GeminiDDP",
    "GeminiOptimizer",
    "LossScaleConfig",
    "LowLevelZeroOptimizer",
    "MixedPrecision",
    "ModelStateMemory",
    "ModuleSizePolicy",
    "NonFiniteGradientError",
    "OwnedPiece",
    "Pieces",
    "PiecesLoadPlanner",
    "PiecesSavePlanner",
    "PlacementPolicy",
    "SafeFileSystemReader",
    "ShardedModule",
    "ShardedOptimizer",
    "Slot",
    "TransformerBlockPolicy",
    "UnsafeCheckpointError",
    "counts_under_tensor_parallel",
    "flat_range_boxes",
    "load_sharded_checkpoint",
    "merge_sharded_state_dicts",
    "named_dcp_failures",
    "plan_buckets",
    "read_metadata",
    "refuse_weights_only",
    "safe_load_bytes",
    "save_sharded_checkpoint",
    "searched_chunk_size",
    "size_based_auto_wrap_policy",
    "step_together",
    "transformer_auto_wrap_policy",
    "unscale_clip_and_check",
    "zero_paper_bytes",
]
