"""What ``Booster.boost`` returns in place of the optimizer: a
:class:`BoostedOptimizer`, a wrapper object over the optimizer that updates
the parameters (the user's own, one rebuilt over sharded parameters, or a
pc-zero optimizer), which runs the plugin's gradient-step policy
[Note: boosted optimizer].

[Note: boosted optimizer]
pc never changes the class of a user's object nor writes private state on
it. Behaviour that belongs to a step (fp16 unscaling and overflow skipping)
and clipping live in the plugin's :class:`~pc_booster.step_policies.GradientStep`
held by the wrapper [Note: one step policy]. Objects the user
built before ``boost`` keep working: an LR scheduler built over the user's
optimizer wraps that *instance's* ``step`` (torch's LRScheduler captures the
class's function at construction, which is why a class swap broke fp16
before), and the wrapper's ``step`` calls that instance attribute, so the
scheduler sees every applied step; the scheduler's param groups are the
inner optimizer's, which the wrapper shares rather than copies. Objects built
after ``boost`` over the wrapper (a scheduler, ``register_step_pre_hook`` /
``register_step_post_hook`` for an EMA) see the wrapper's step; its
post-hooks run only for a step that was applied (not for one skipped on an
fp16 overflow), as with torch's ``GradScaler``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from pc_booster.step_policies import GradientStep

__all__ = ["BoostedOptimizer", "OptimizerView", "StepOwner", "inner_optimizer"]


class StepOwner(Protocol):
    """What the wrapper asks of the plugin that boosted it."""

    def backward(self, loss: torch.Tensor, optimizer: Optimizer) -> None: ...


class OptimizerView(Optimizer):
    """An optimizer object whose ``param_groups``, ``state`` and
    ``defaults`` are another optimizer's (``viewed()``; not copies: LR
    schedulers write them there). ``Optimizer.__init__`` is not called, as
    it would register the parameters again in new param groups; what it
    sets that torch's ``register_step_*`` hooks use is set here."""

    def viewed(self) -> Optimizer:
        raise NotImplementedError

    def _hook_tables(self) -> None:
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.viewed().param_groups
        return groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.viewed().param_groups = groups

    @property
    def state(self) -> Any:
        return self.viewed().state

    @state.setter
    def state(self, state: Any) -> None:
        self.viewed().state = state

    @property
    def defaults(self) -> dict[str, Any]:
        defaults: dict[str, Any] = self.viewed().defaults
        return defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.viewed().defaults = defaults


class BoostedOptimizer(OptimizerView):
    """The optimizer ``boost`` returns [Note: boosted optimizer]:
    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's
    (not copies), ``step`` runs the plugin's policy, and ``backward``,
    ``clip_grad_by_norm`` and ``unwrap`` are here. Any other attribute reads through to the inner
    optimizer (a pc-zero optimizer's ``memory()``, ``loss_scale``)."""

    def __init__(self, inner: Optimizer, plugin: StepOwner, policy: GradientStep) -> None:
        object.__setattr__(self, "inner", inner)
        # The plugin that boosted it: backward goes through it.
        self.plugin = plugin
        # The step: scale, unscale, clip, skip or step [Note: one step policy].
        self.policy = policy
        self._hook_tables()

    def viewed(self) -> Optimizer:
        inner: Optimizer = self.inner
        return inner

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the inner optimizer's own
        # attributes. "inner" itself missing means a half-built object.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"BoostedOptimizer({self.inner!r})"

    # -- stepping -------------------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        """The plugin's step [Note: boosted optimizer]: this wrapper's
        pre-hooks, the policy (unscale, skip on overflow, or the inner
        optimizer's step, whose own hooks and LR-scheduler patch run), then
        this wrapper's post-hooks if the step was applied."""
        args: tuple[Any, ...] = (closure,)
        kwargs: dict[str, Any] = {}
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), "
                        f"but got {result}."
                    )
                args, kwargs = result
        applied, out = self.policy.step(self.inner, *args, **kwargs)
        if applied:
            for post_hook in list(self._optimizer_step_post_hooks.values()):
                post_hook(self, args, kwargs)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's (a torch optimizer's own form; Booster's
        save_optimizer writes the canonical form that loads anywhere)."""
        state: dict[str, Any] = self.inner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    # -- backward, clipping, unwrap ------------------------------------------------------

    def unwrap(self) -> Optimizer:
        """The torch optimizer that updates the parameters (the one a ZeRO
        or Gemini optimizer drives, else the inner optimizer)."""
        driven = getattr(self.inner, "inner", None)
        return driven if isinstance(driven, Optimizer) else self.inner

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` as the plugin needs it (``booster.backward``):
        scaled for fp16, through a pc-zero optimizer's own backward."""
        self.plugin.backward(self.policy.scale_loss(loss), self.inner)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Clip the gradients by their global 2-norm over every rank that
        holds a piece of them. Call it after backward and before
        ``step()``. Under fp16 the gradients are unscaled first (once per
        step); a step whose gradients overflowed is skipped, so nothing is
        clipped. Where gradients are sharded or reduced inside the step
        (ZeRO, Gemini), the clipping is applied by that step."""
        if norm_type != 2.0:
            raise ValueError(
                f"clip_grad_by_norm: pc clips by the global 2-norm, got norm_type={norm_type}; "
                "pass norm_type=2.0."
            )
        if max_norm <= 0:
            raise ValueError(f"clip_grad_by_norm: max_norm must be > 0, got {max_norm}.")
        if not self.policy.unscale(self.inner):
            if error_if_nonfinite:
                raise RuntimeError(
                    "clip_grad_by_norm: the gradients' total norm is non-finite "
                    "(error_if_nonfinite=True)."
                )
            return
        self.policy.clip(self.inner, float(max_norm), error_if_nonfinite)


def inner_optimizer(optimizer: Optimizer | None) -> Any:
    """The plugin's optimizer behind what ``boost`` returned (or
    ``optimizer`` itself when it is not a :class:`BoostedOptimizer`)."""
    return optimizer.inner if isinstance(optimizer, BoostedOptimizer) else optimizer
