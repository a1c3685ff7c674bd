"""Gradient clipping by the global norm where every rank holds whole
gradients or FSDP2's DTensor shards (a :class:`~pc_booster.step_policies.Clip`
for the step policy, [Note: one step policy])."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pc_zero import NonFiniteGradientError

__all__ = ["clip_replicated"]


def clip_replicated(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip gradients every rank holds whole (after DDP's all-reduce), or
    DTensor gradients (FSDP2's, and FSDP2's over tensor-parallel ones),
    whose norm torch reduces over their mesh. Gradients on different meshes
    (a tensor-parallel weight on (dp, tp), a norm weight on dp alone) are
    normed per mesh and combined: torch's ``clip_grad_norm_`` refuses to
    stack norms of different meshes. A non-finite norm raises
    :class:`~pc_zero.NonFiniteGradientError` with nothing changed."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    squares = torch.zeros((), dtype=torch.float64)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        full = getattr(norm, "full_tensor", None)
        squares += float(full() if full is not None else norm) ** 2
    total = torch.sqrt(squares).float()  # one mesh: exactly torch's norm
    if not bool(torch.isfinite(total)):  # a NaN coefficient would poison every gradient
        raise NonFiniteGradientError(float(total))
    # As torch's clip_grads_with_norm_, in fp32; a Python scalar multiplies
    # the gradients of each mesh in one foreach call.
    coef = float(torch.clamp(torch.tensor(max_norm) / (total + 1e-6), max=1.0))
    if coef < 1.0:  # a norm under max_norm (pc-train's check-only clip: always) changes nothing
        with torch.no_grad():
            for grads in by_mesh.values():
                torch._foreach_mul_(grads, coef)
    return float(total)
