"""``colossalai.checkpoint_io``: ``GeneralCheckpointIO``, checkpoints of one
process's model, optimizer and LR scheduler (no plugin; under a plugin use
``booster.checkpoint_io`` or the Booster's own methods)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["GeneralCheckpointIO"]


def _load(path: str | os.PathLike[str]) -> Any:
    """A file's state; nothing in it runs as code (safetensors, or torch's
    weights-only unpickler)."""
    if Path(path).suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


class GeneralCheckpointIO:
    """Whole-state checkpoints of an unwrapped model, optimizer and LR
    scheduler in one file each: ``.safetensors`` for a model whose name ends
    so (or ``use_safetensors=True``), ``torch.save`` otherwise. Reads never
    unpickle code. Sharded checkpoints are the Booster's."""

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        if shard or use_async:
            raise ValueError(
                "GeneralCheckpointIO.save_model(shard=True / use_async=True): sharded and "
                "async saves are the Booster's (booster.save_model); this one writes one file."
            )
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        if use_safetensors or Path(checkpoint).suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(checkpoint))
        else:
            torch.save(state, checkpoint)

    def load_model(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
    ) -> None:
        model.load_state_dict(_load(checkpoint), strict=strict)

    def save_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: str | os.PathLike[str]
    ) -> None:
        torch.save(optimizer.state_dict(), checkpoint)

    def load_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: str | os.PathLike[str]
    ) -> None:
        optimizer.load_state_dict(_load(checkpoint))

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        torch.save(lr_scheduler.state_dict(), checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        lr_scheduler.load_state_dict(_load(checkpoint))
