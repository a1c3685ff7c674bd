"""``colossalai``: ``launch`` and ``launch_from_torch`` (pc-comm's), and the
subpackages a Colossal-AI program imports."""

from __future__ import annotations

from pc_comm import launch, launch_from_torch

__all__ = ["launch", "launch_from_torch"]
