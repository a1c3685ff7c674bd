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
    DDPOptions,
    DDPPlugin,
    GeminiOptions,
    GeminiPlugin,
    HybridParallelOptions,
    HybridParallelPlugin,
    LowLevelZeroOptions,
    LowLevelZeroPlugin,
    ParallelLayout,
    TorchDDPOptions,
    TorchDDPPlugin,
    TorchFSDPOptions,
    TorchFSDPPlugin,
)
from pc_booster.rules import PluginConfig, RunSetting, TrainPrecision
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
    "DDPOptions",
    "DDPPlugin",
    "GeminiOptions",
    "GeminiPlugin",
    "HybridParallelOptions",
    "HybridParallelPlugin",
    "LowLevelZeroOptions",
    "LowLevelZeroPlugin",
    "ParallelLayout",
    "Plugin",
    "PluginConfig",
    "RunSetting",
    "SupportsNoSync",
    "SupportsPipeline",
    "TorchDDPOptions",
    "TorchDDPPlugin",
    "TorchFSDPOptions",
    "TorchFSDPPlugin",
    "TrainConfig",
    "TrainPrecision",
    "estimate",
    "load_byte_corpus",
    "recommend",
    "train",
]
