"""``haiscale.cpu_offload``: ``CPUOffload`` (pc-offload's)."""

from __future__ import annotations

from pc_offload import CPUOffload

__all__ = ["CPUOffload"]
