"""pc-booster: the meta-package of pc. Installing it brings every layer.

``Booster`` with its plugins (``TorchDDPPlugin``, ``DDPPlugin``,
``LowLevelZeroPlugin``, ``TorchFSDPPlugin``, ``GeminiPlugin``,
``HybridParallelPlugin``), checkpoints any plugin loads at any world size,
the ``pc-train`` command (:mod:`pc_booster.train`) and ``pc-estimate``
(:mod:`pc_booster.estimate`).
"""

from pc_booster.booster import Booster
from pc_booster.data import load_byte_corpus
from pc_booster.estimate import estimate, recommend
from pc_booster.plugin import Plugin, SupportsNoSync, SupportsPipeline
from pc_booster.plugins import (
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_booster.train_config import TrainConfig


def __getattr__(name: str) -> object:
    # Imported on use, so `python -m pc_booster.train` does not find the
    # module already loaded by the package.
    if name == "train":
        from pc_booster.train import train

        return train
    raise AttributeError(f"module 'pc_booster' has no attribute {name!r}")


__all__ = [
    "Booster",
    "DDPPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "Plugin",
    "SupportsNoSync",
    "SupportsPipeline",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "TrainConfig",
    "estimate",
    "load_byte_corpus",
    "recommend",
    "train",
]
