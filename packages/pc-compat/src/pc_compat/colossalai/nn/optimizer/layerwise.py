"""Colossal-AI's layer-wise optimizers, ``Lamb`` and ``Lars``: each
parameter's update is scaled by a trust ratio, a ratio of two norms of the
whole parameter.

Both step the parameters they are given; both declare
``needs_whole_tensors`` (a class attribute), so a plugin whose optimizer
steps shards (ZeRO, Gemini, FSDP, tensor parallelism) refuses them at
``boost`` rather than computing a shard's norm [Note: whole-tensor
optimizers] (Colossal-AI's would step such shards without a word; its
``DistributedLamb`` is the sharded form, which pc does not have).

The arithmetic is Colossal-AI's, term for term:

- ``Lamb``: Adam's moments without bias correction (``bias_correction=True``
  scales the rate by ``sqrt(1 - beta2^t) / (1 - beta1^t)``), the step
  ``m / (sqrt(v) + eps) + weight_decay * p``, the trust ratio
  ``|p| / |step|`` (1 where either norm is 0, or with ``adam=True``).
- ``Lars``: the trust ratio ``eeta |p| / (|g| + weight_decay |p| + epsilon)``
  (1 where either norm is 0), clamped to [0, 50]; the gradient plus the
  decay, clamped to [-10, 10], through a momentum buffer that starts at the
  first such gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

__all__ = ["Lamb", "Lars"]


def _check(name: str, value: float, ok: bool) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value}")


class Lamb(Optimizer):
    """``Lamb(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0,
    adam=False, bias_correction=False)``, Colossal-AI's (module docstring)."""

    needs_whole_tensors: ClassVar[bool] = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        adam: bool = False,
        bias_correction: bool = False,
    ) -> None:
        _check("learning rate", lr, lr >= 0.0)
        _check("epsilon value", eps, eps >= 0.0)
        _check("beta parameter at index 0", betas[0], 0.0 <= betas[0] < 1.0)
        _check("beta parameter at index 1", betas[1], 0.0 <= betas[1] < 1.0)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction}  # fmt: skip
        # Trust ratio 1: Adam without bias correction (for comparison).
        self.adam = adam
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not take sparse gradients; use SparseAdam.")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                rate = group["lr"]
                if group["bias_correction"]:
                    t = state["step"]
                    rate *= (1 - beta2**t) ** 0.5 / (1 - beta1**t)
                update = m / v.sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                p_norm, u_norm = p.norm(), update.norm()
                trust = 1.0
                if not self.adam and p_norm != 0 and u_norm != 0:
                    trust = float(p_norm / u_norm)
                p.add_(update, alpha=-rate * trust)
        return loss


class Lars(Optimizer):
    """``Lars(params, lr=1e-3, momentum=0, eeta=1e-3, weight_decay=0,
    epsilon=0.0)``, Colossal-AI's (module docstring)."""

    needs_whole_tensors: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0,
        eeta: float = 1e-3,
        weight_decay: float = 0,
        epsilon: float = 0.0,
    ) -> None:
        _check("learning rate", lr, isinstance(lr, float) and lr >= 0.0)
        _check("momentum value", momentum, momentum >= 0.0)
        _check("weight_decay value", weight_decay, weight_decay >= 0.0)
        _check("eeta value", eeta, 0 < eeta <= 1)
        _check("epsilon value", epsilon, epsilon >= 0)
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eeta": eeta,
                    "epsilon": epsilon, "lars": True}  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, rate = p.grad, group["lr"]
                if group["lars"]:
                    p_norm, g_norm = p.norm(), p.grad.norm()
                    trust = 1.0
                    if p_norm > 0 and g_norm > 0:
                        below = g_norm + decay * p_norm + group["epsilon"]
                        trust = float((group["eeta"] * p_norm / below).clamp(0.0, 50.0))
                    rate *= trust
                    if decay != 0:
                        grad = grad.add(p, alpha=decay)
                grad = grad.clamp(-10.0, 10.0)
                if momentum != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = grad.clone()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(grad)
                    grad = state["momentum_buffer"]
                p.add_(grad, alpha=-rate)
        return loss
