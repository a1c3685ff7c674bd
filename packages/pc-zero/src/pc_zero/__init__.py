"""pc-zero: ZeRO-1/2 (`LowLevelZeroOptimizer`); ZeRO-3 / FSDP and the
chunk-based Gemini come with issue 7."""

from pc_zero.layout import Bucket, Slot, plan_buckets
from pc_zero.loss_scale import DynamicLossScaler, LossScaleConfig
from pc_zero.low_level_zero import LowLevelZeroOptimizer
from pc_zero.memory import ModelStateMemory, zero_paper_bytes
from pc_zero.state import merge_sharded_state_dicts

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "DynamicLossScaler",
    "LossScaleConfig",
    "LowLevelZeroOptimizer",
    "ModelStateMemory",
    "Slot",
    "merge_sharded_state_dicts",
    "plan_buckets",
    "zero_paper_bytes",
]
