"""``colossalai``: ``launch`` and ``launch_from_torch`` with Colossal-AI's
defaults (``backend='nccl'``), and the subpackages a Colossal-AI program
imports."""

from __future__ import annotations

from typing import Any

import torch

from pc_comm import DistContext
from pc_comm import launch as _launch
from pc_comm import launch_from_torch as _launch_from_torch

__all__ = ["launch", "launch_from_torch"]


def _backend(backend: str | None) -> str | None:
    """``'nccl'`` (Colossal-AI's default) where no GPU is visible would fail
    there; here it falls back to gloo, which is what a CPU run needs."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "gloo"
    return backend


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "nccl",
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    **kwargs: Any,
) -> DistContext:
    """pc-comm's ``launch`` (``kwargs``: pc's ``config``, ``timeout``,
    ``health_interval``)."""
    return _launch(
        rank, world_size, host, port, _backend(backend), local_rank, seed, verbose, **kwargs
    )


def launch_from_torch(
    backend: str = "nccl", seed: int = 1024, verbose: bool = True, **kwargs: Any
) -> DistContext:
    """pc-comm's ``launch_from_torch`` under torchrun (``kwargs``: pc's
    ``config``, ``timeout``, ``health_interval``)."""
    return _launch_from_torch(_backend(backend), seed, verbose, **kwargs)
