"""``colossalai.booster.plugin.dp_plugin_base``."""

from __future__ import annotations

from pc_compat.colossalai.booster.plugin import DPPluginBase

__all__ = ["DPPluginBase"]
