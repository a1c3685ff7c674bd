"""Colossal-AI's wrapper methods on what ``Booster.boost`` returns.

Colossal-AI hands back a ``ModelWrapper`` (``model.unwrap()``) and an
``OptimizerWrapper`` (``optimizer.unwrap()``, ``optimizer.backward(loss)``,
``optimizer.clip_grad_by_norm(max_norm)``). pc returns the plugin's own
objects (a torch ``DistributedDataParallel``, an FSDP2 module, a pc-zero
optimizer or the user's torch optimizer), and adds those methods the way
FSDP2's ``fully_shard`` adds its own: the object's class is swapped for a
subclass that mixes them in [Note: boosted classes]. So ``isinstance``
checks, ``state_dict`` keys and every attribute stay as they were; a method
the object already has (a pc-zero optimizer's ``backward``) is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pc_booster.plugin import Plugin

__all__ = ["BoostedModel", "BoostedOptimizer", "mark_boosted", "mix_before"]

T = TypeVar("T")

# [Note: boosted classes]
# One subclass per (original class, mixin), made once and reused. The
# mixin comes after the original class in the bases, so the original's
# methods win. The subclass keeps the original's name and module, so
# reprs and error messages read as before. The references the mixins need
# live in the instance __dict__ under a private name, set with
# object.__setattr__: nn.Module.__setattr__ would register a module value
# as a submodule (and the model may be its own unwrapped module).
_CLASSES: dict[tuple[type, type], type] = {}
_UNWRAPPED = "_pc_unwrapped"
_PLUGIN = "_pc_plugin"


def _mix(obj: Any, mixin: type, first: bool = False) -> None:
    """Swap ``obj``'s class for a subclass with ``mixin`` after the original
    class in the MRO (the original's methods win), or before it with
    ``first`` (the mixin's win and reach the original's through ``super()``)."""
    cls = type(obj)
    if isinstance(obj, mixin):
        return
    key = (mixin, cls) if first else (cls, mixin)
    if key not in _CLASSES:
        _CLASSES[key] = type(
            cls.__name__, key, {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    obj.__class__ = _CLASSES[key]


def mix_before(obj: Any, mixin: type) -> None:
    """Put ``mixin`` before ``obj``'s class in its MRO [Note: boosted classes]."""
    _mix(obj, mixin, first=True)


class BoostedModel:
    """Colossal-AI's ``ModelWrapper`` methods on a boosted model."""

    def unwrap(self) -> nn.Module:
        """The model as it was built (tensor-parallel layers stay split,
        FSDP2 parameters stay DTensors: the module, not a gathered copy)."""
        module: nn.Module = self.__dict__[_UNWRAPPED]
        return module


class BoostedOptimizer:
    """Colossal-AI's ``OptimizerWrapper`` methods on a boosted optimizer."""

    def unwrap(self) -> torch.optim.Optimizer:
        """The torch optimizer that updates the parameters (the one a ZeRO
        or Gemini optimizer drives, or this one)."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
        assert isinstance(self, torch.optim.Optimizer)
        return self

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the plugin needs it (``booster.backward``)."""
        plugin: Plugin = self.__dict__[_PLUGIN]
        plugin.backward(loss, self)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> None:
        """Clip the gradients by their global 2-norm, over every rank that
        holds a piece of them. Call it after backward and before
        ``step()``; where gradients are sharded or reduced inside the step
        (ZeRO, Gemini), the clipping is applied by that step."""
        plugin: Plugin = self.__dict__[_PLUGIN]
        if norm_type != 2.0:
            raise ValueError(
                f"clip_grad_by_norm: pc clips by the global 2-norm, got norm_type={norm_type}; "
                "pass norm_type=2.0."
            )
        if error_if_nonfinite:
            raise ValueError(
                "clip_grad_by_norm: error_if_nonfinite=True is not supported; pc skips a step "
                "whose gradients overflow under fp16 and clips finite ones."
            )
        if max_norm <= 0:
            raise ValueError(f"clip_grad_by_norm: max_norm must be > 0, got {max_norm}.")
        plugin.clip_grad_by_norm(self, float(max_norm))


def mark_boosted(model: T, module: nn.Module, optimizer: Any, plugin: Plugin) -> None:
    """Give the boosted ``model`` and ``optimizer`` Colossal-AI's wrapper
    methods [Note: boosted classes]; ``module``: the model as built."""
    try:
        _mix(model, BoostedModel)
    except TypeError:  # a class that cannot be swapped (slots, C types): left as it is
        pass
    else:
        object.__setattr__(model, _UNWRAPPED, module)
    if optimizer is not None:
        try:
            _mix(optimizer, BoostedOptimizer)
        except TypeError:
            return
        object.__setattr__(optimizer, _PLUGIN, plugin)


def runs_own_backward(optimizer: Any) -> bool:
    """The optimizer runs backward itself (the loss scale of the ZeRO and
    Gemini optimizers), not through :class:`BoostedOptimizer`'s."""
    own = getattr(type(optimizer), "backward", None)
    return own is not None and own is not BoostedOptimizer.backward
