"""pc-booster: the meta-package of pc. Installing it brings every layer.

``Booster`` with its plugins (``TorchDDPPlugin``, ``DDPPlugin``,
``LowLevelZeroPlugin``, ``TorchFSDPPlugin``, ``GeminiPlugin``,
``HybridParallelPlugin``), checkpoints any plugin loads at any world size,
and the ``pc-train`` command (:mod:`pc_booster.train`).
"""

from pc_booster.booster import Booster
from pc_booster.plugin import Plugin, SupportsNoSync, SupportsPipeline
from pc_booster.plugins import (
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_booster.train import TrainConfig, load_byte_corpus, train

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
    "load_byte_corpus",
    "train",
]
