"""``colossalai``: ``launch`` and ``launch_from_torch`` with Colossal-AI's
defaults (``backend='nccl'``, which falls back to gloo where no GPU is
visible), and the subpackages a Colossal-AI program imports."""

from __future__ import annotations

from pc_compat.colossalai._launch import (
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)

__all__ = ["__version__", "launch", "launch_from_openmpi", "launch_from_slurm", "launch_from_torch"]

# The Colossal-AI release whose public API the edge mirrors (the commit of
# signatures/colossalai.json), for programs that print or compare it.
__version__ = "0.5.0"
