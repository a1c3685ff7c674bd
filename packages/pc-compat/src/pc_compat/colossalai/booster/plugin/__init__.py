"""``colossalai.booster.plugin``: the plugins with Colossal-AI's defaults.

pc's own plugins (``pc_booster``) train in the dtype the model was built in
unless told otherwise; Colossal-AI's ``LowLevelZeroPlugin``,
``GeminiPlugin`` and ``HybridParallelPlugin`` default to
``precision="fp16"``, and so do these. Every other argument and default is
pc's plugin's, which takes Colossal-AI's names (the surface test checks them
against Colossal-AI's own signatures)."""

from __future__ import annotations

import inspect
from typing import Any

from pc_booster import plugin as _core
from pc_booster.plugin import DDPPlugin, Plugin, TorchDDPPlugin, TorchFSDPPlugin

__all__ = [
    "DDPPlugin",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]

_ORIGINAL_PRECISION = "fp16"


def _bind_precision(core: type[Plugin], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``args`` / ``kwargs`` bound to ``core``'s constructor, with
    Colossal-AI's precision where none was given."""
    signature = inspect.signature(core.__init__)
    bound = signature.bind_partial(None, *args, **kwargs)
    bound.arguments.setdefault("precision", _ORIGINAL_PRECISION)
    return bound


def _edge_signature(core: type[Plugin]) -> inspect.Signature:
    signature = inspect.signature(core.__init__)
    return signature.replace(
        parameters=[
            p.replace(default=_ORIGINAL_PRECISION) if p.name == "precision" else p
            for p in signature.parameters.values()
        ]
    )


class LowLevelZeroPlugin(_core.LowLevelZeroPlugin):
    """pc's ``LowLevelZeroPlugin``, fp16 by default as Colossal-AI's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind_precision(_core.LowLevelZeroPlugin, args, kwargs)
        super().__init__(*bound.args[1:], **bound.kwargs)


class GeminiPlugin(_core.GeminiPlugin):
    """pc's ``GeminiPlugin``, fp16 by default as Colossal-AI's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind_precision(_core.GeminiPlugin, args, kwargs)
        super().__init__(*bound.args[1:], **bound.kwargs)


class HybridParallelPlugin(_core.HybridParallelPlugin):
    """pc's ``HybridParallelPlugin``, fp16 by default as Colossal-AI's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind_precision(_core.HybridParallelPlugin, args, kwargs)
        super().__init__(*bound.args[1:], **bound.kwargs)


_edge: type[Plugin]
for _edge in (LowLevelZeroPlugin, GeminiPlugin, HybridParallelPlugin):
    # inspect.signature(GeminiPlugin) then shows pc's parameters with
    # Colossal-AI's precision default, as the surface test reads them.
    setattr(_edge.__init__, "__signature__", _edge_signature(_edge.__mro__[1]))  # noqa: B010
