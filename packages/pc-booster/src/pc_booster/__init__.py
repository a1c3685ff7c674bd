"""pc-booster: the meta-package of pc. Installing it brings every layer.

``Booster`` with its plugins (``TorchDDPPlugin``, ``DDPPlugin``,
``LowLevelZeroPlugin``, ``TorchFSDPPlugin``, ``GeminiPlugin``,
``HybridParallelPlugin``) and checkpoints any plugin loads at any world
size. The ``pc-train`` and ``pc-estimate`` commands built on it are the
pc-train package (:mod:`pc_train`).
"""

from pc_booster.booster import Booster
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
from pc_zero import NonFiniteGradientError  # what a step raises on a non-finite norm

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
    "NonFiniteGradientError",
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
    "TrainPrecision",
]
