"""The plugins, one module each, and their options dataclasses
[Note: one place for every rule]:

- :mod:`.ddp`: ``TorchDDPPlugin``, ``DDPPlugin``
- :mod:`.low_level_zero`: ``LowLevelZeroPlugin`` (ZeRO-1/2)
- :mod:`.torch_fsdp`: ``TorchFSDPPlugin`` (FSDP2)
- :mod:`.gemini`: ``GeminiPlugin`` (chunk-based ZeRO-3)
- :mod:`.hybrid`: ``HybridParallelPlugin`` (tp x pp x dp), with its
  pipeline in :mod:`.hybrid_pipeline` and state in :mod:`.hybrid_state`
"""

from pc_booster.plugins.ddp import DDPOptions, DDPPlugin, TorchDDPOptions, TorchDDPPlugin
from pc_booster.plugins.gemini import GeminiOptions, GeminiPlugin
from pc_booster.plugins.hybrid import HybridParallelPlugin
from pc_booster.plugins.hybrid_options import HybridParallelOptions
from pc_booster.plugins.layout import ParallelLayout
from pc_booster.plugins.low_level_zero import LowLevelZeroOptions, LowLevelZeroPlugin
from pc_booster.plugins.torch_fsdp import TorchFSDPOptions, TorchFSDPPlugin
from pc_booster.rules import PluginConfig, Rule, RunSetting, StateBytes, TrainPrecision

#: every plugin's options class, in the order the docs list them
PLUGIN_OPTIONS: tuple[type[PluginConfig], ...] = (
    TorchDDPOptions,
    DDPOptions,
    LowLevelZeroOptions,
    TorchFSDPOptions,
    GeminiOptions,
    HybridParallelOptions,
)

__all__ = [
    "PLUGIN_OPTIONS",
    "DDPOptions",
    "DDPPlugin",
    "GeminiOptions",
    "GeminiPlugin",
    "HybridParallelOptions",
    "HybridParallelPlugin",
    "LowLevelZeroOptions",
    "LowLevelZeroPlugin",
    "ParallelLayout",
    "PluginConfig",
    "Rule",
    "RunSetting",
    "StateBytes",
    "TorchDDPOptions",
    "TorchDDPPlugin",
    "TorchFSDPOptions",
    "TorchFSDPPlugin",
    "TrainPrecision",
]
