"""Hooks on tensors that do not keep their owner alive.

[Note: post-accumulate-grad hooks and reference cycles]
A hook given to ``Tensor.register_post_accumulate_grad_hook`` is held from
the tensor's C++ autograd metadata, where Python's cycle collector cannot
see it. A bound method of an object that holds the parameters (a DDP
wrapper, a ZeRO optimizer, a chunk manager) then makes a cycle the collector
never frees: deleting the wrapper leaked the model, its gradients and its
optimizer states (a whole ZeRO-1 run per ``Booster.boost`` in one process,
found by counting live tensors, torch 2.13). Registering a weak method
breaks it: the hook calls its owner while the owner lives and does nothing
after.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["weak_method"]


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls the bound ``method`` while its object lives,
    and returns None once it is gone, without keeping it alive [Note:
    post-accumulate-grad hooks and reference cycles]."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call
