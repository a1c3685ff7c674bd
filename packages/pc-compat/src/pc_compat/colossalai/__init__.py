"""``colossalai``: ``launch`` and ``launch_from_torch`` with Colossal-AI's
defaults (``backend='nccl'``, which falls back to gloo where no GPU is
visible), and the subpackages a Colossal-AI program imports."""

from __future__ import annotations

from pc_compat.colossalai._launch import launch, launch_from_torch

__all__ = ["launch", "launch_from_torch"]
