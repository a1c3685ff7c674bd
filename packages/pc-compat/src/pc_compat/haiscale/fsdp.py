"""``haiscale.fsdp``: ``FullyShardedDataParallel`` (pc-zero's)."""

from __future__ import annotations

from pc_zero import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
