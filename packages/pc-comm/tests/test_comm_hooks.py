"""weak_method: a gradient hook that does not keep its owner alive."""

from __future__ import annotations

import gc
import weakref

import torch

from pc_comm import weak_method


class _Owner:
    def __init__(self, weak: bool) -> None:
        self.param = torch.nn.Parameter(torch.ones(3))
        self.calls = 0
        hook = weak_method(self._on_grad) if weak else self._on_grad
        self.param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    def _on_grad(self, param: torch.Tensor) -> None:
        self.calls += 1


def _alive_after_del(weak: bool) -> bool:
    owner = _Owner(weak)
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    return ref() is not None


def test_a_bound_hook_leaks_its_owner_and_a_weak_one_does_not() -> None:
    # torch keeps post-accumulate-grad hooks where the collector cannot see
    # them: the bound method's cycle is never freed. If this first assert
    # ever fails, torch fixed it and weak_method is no longer needed.
    assert _alive_after_del(weak=False)
    assert not _alive_after_del(weak=True)


def test_the_weak_hook_still_calls_its_owner() -> None:
    owner = _Owner(weak=True)
    (owner.param * 2).sum().backward()  # type: ignore[no-untyped-call]
    (owner.param * 3).sum().backward()  # type: ignore[no-untyped-call]
    assert owner.calls == 2
