"""pc-compat: Colossal-AI's and haiscale's module trees over pc.

``from pc_compat import colossalai`` stands for ``import colossalai``;
``from pc_compat.colossalai.booster import Booster`` for
``from colossalai.booster import Booster``; the same for ``haiscale``.
The signatures mirrored are checked against the originals' own, extracted
as data into ``signatures/`` (``tools/extract_signatures.py``)."""

from __future__ import annotations

from pc_compat import colossalai, haiscale

__all__ = ["colossalai", "haiscale"]
