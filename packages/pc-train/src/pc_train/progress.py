"""What rank 0 shows while a run trains: a tqdm progress bar on a
terminal or plain lines every ``--log-every`` steps (:class:`Progress`),
and the TensorBoard writer (:func:`tensorboard_writer`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pc_train.train_config import TrainConfig

__all__ = ["Progress", "tensorboard_writer"]


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, config: TrainConfig, start: int, enabled: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled
        if enabled and config.progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

                self.bar = tqdm(total=config.steps, initial=start, desc="pc-train", unit="step")
            except ImportError:
                pass

    def update(self, step: int, total: int, fields: dict[str, str], log: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if log:
                self.bar.set_postfix(fields, refresh=True)
        elif log:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            print(f"step {step:>6}/{total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tensorboard_writer(config: TrainConfig, enabled: bool) -> Any:
    if not (enabled and config.tensorboard):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("pc-train: TensorBoard logs skipped: pip install tensorboard", flush=True)
        return None
    return SummaryWriter(str(Path(config.output_dir) / "tensorboard"))
