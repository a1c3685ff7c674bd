"""``colossalai.booster``: ``Booster`` and its plugins."""

from __future__ import annotations

from pc_compat.colossalai.booster import plugin
from pc_compat.colossalai.booster.booster import Booster, CheckpointIO

__all__ = ["Booster", "CheckpointIO", "plugin"]
