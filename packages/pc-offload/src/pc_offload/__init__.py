"""pc-offload: activation CPU offload, Adam optimizers that step fp32 master
weights on the host (or wherever each parameter lives), and a bounded pool
of pinned host buffers with an asynchronous copy engine. Adam's moments may
be stored in bf16 or 8 bits (``state_dtype``)."""

from pc_offload.activation import CPUOffload, OffloadStats
from pc_offload.convert import adam_storing, check_own_masters, check_storable
from pc_offload.nvme import NvmeSpaceError, NvmeStats, NvmeTier
from pc_offload.optim import CPUAdam, CPUAdamW, HybridAdam
from pc_offload.pool import (
    CopyEngine,
    PinnedPool,
    PoolExhaustedError,
    PoolStats,
    Transfer,
    pinned_empty,
)
from pc_offload.states import (
    StateDtype,
    is_narrow,
    moment_bytes,
    parse_state_dtype,
    stored_bytes,
    widen,
)

__version__ = "0.1.0"

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "CPUOffload",
    "CopyEngine",
    "HybridAdam",
    "NvmeSpaceError",
    "NvmeStats",
    "NvmeTier",
    "OffloadStats",
    "PinnedPool",
    "PoolExhaustedError",
    "PoolStats",
    "StateDtype",
    "Transfer",
    "adam_storing",
    "check_own_masters",
    "check_storable",
    "is_narrow",
    "moment_bytes",
    "parse_state_dtype",
    "pinned_empty",
    "stored_bytes",
    "widen",
]
