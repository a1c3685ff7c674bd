"""``colossalai.nn.optimizer``: ``HybridAdam`` and ``CPUAdam`` (pc-offload's)."""

from __future__ import annotations

from pc_offload import CPUAdam, HybridAdam

__all__ = ["CPUAdam", "HybridAdam"]
