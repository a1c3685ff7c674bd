"""``colossalai.legacy.zero.gemini``: ``ColoInitContext`` with Colossal-AI's
signature and defaults (tensors made on the host unless ``device`` says
otherwise) over the older tutorial's (``pc_compat.colossalai.legacy.zero``);
pc's ``lazy=True`` is a keyword after the original's arguments."""

from __future__ import annotations

from typing import Any

from pc_compat.colossalai.legacy.zero import _tutorial as _colossal
from pc_compat.surface import Translation

__all__ = ["ColoInitContext"]


class ColoInitContext(_colossal.ColoInitContext):
    """Colossal-AI's ``with ColoInitContext(device=, dtype=): model = ...``:
    parameters and buffers made on ``device`` in ``dtype``; the
    tensor-parallel specs (``default_pg``, ``default_dist_spec``) are refused
    by the older tutorial's (pc_compat.colossalai.legacy.zero)'s, with the alternative."""

    CORE = _colossal.ColoInitContext
    TRANSLATION = Translation("colossalai.legacy.zero.gemini", "ColoInitContext")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**ColoInitContext.TRANSLATION.to_pc(ColoInitContext.CORE, args, kwargs))


setattr(  # noqa: B010
    ColoInitContext.__init__,
    "__signature__",
    ColoInitContext.TRANSLATION.signature(ColoInitContext.CORE),
)
