"""``colossalai.nn.optimizer``: ``HybridAdam`` and ``CPUAdam`` (pc-offload's
fp32-master Adam), ``FusedAdam`` and ``FusedSGD`` (torch's Adam / AdamW and
SGD, which run fused or foreach kernels where torch has them), the
layer-wise ``Lamb`` and ``Lars`` (:mod:`.layerwise`), and ``FusedLAMB`` and
the distributed optimizers refused with the reason."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import required

from pc_compat.colossalai.nn.optimizer.layerwise import Lamb, Lars
from pc_compat.surface import refused_class
from pc_offload import CPUAdam as _CPUAdam
from pc_offload import HybridAdam as _HybridAdam

__all__ = [
    "CPUAdam",
    "DistributedAdaFactor",
    "DistributedCAME",
    "DistributedLamb",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HybridAdam",
    "Lamb",
    "Lars",
]

_MODULE = "colossalai.nn.optimizer"
# What Colossal-AI's Adam variants pass on in ``**defaults`` that pc's take.
_ADAM_EXTRAS = ("amsgrad", "maximize")


def _adam_extras(name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(defaults) - set(_ADAM_EXTRAS))
    if unknown:
        raise TypeError(
            f"{name}: unexpected keyword argument(s) {unknown}; besides Colossal-AI's named "
            f"arguments pc takes {list(_ADAM_EXTRAS)}."
        )
    return defaults


class HybridAdam(_HybridAdam):
    """Colossal-AI's ``HybridAdam(model_params, ...)``: pc-offload's, which
    steps fp32 masters on the host and on the accelerator alike."""

    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        **defaults: Any,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
            **_adam_extras("HybridAdam", defaults),
        )


class CPUAdam(_CPUAdam):
    """Colossal-AI's ``CPUAdam(model_params, ...)``: pc-offload's."""

    def __init__(
        self,
        model_params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
        )


class FusedAdam(torch.optim.AdamW):
    """Colossal-AI's ``FusedAdam``: torch's AdamW (``adamw_mode=True``,
    decoupled weight decay) or Adam with the decay added to the gradient
    (``adamw_mode=False``), with torch's fused or foreach kernels where it
    has them. ``set_grad_none``: what ``zero_grad()`` does by default.
    ``bias_correction=False`` is refused: torch's Adam always corrects."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if not bias_correction:
            raise ValueError(
                "FusedAdam(bias_correction=False): torch's Adam always corrects the moments' "
                "bias; use pc_compat.colossalai.nn.optimizer.HybridAdam(bias_correction=False)."
            )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)  # fmt: skip
        # zero_grad()'s default: drop the gradients (True) or zero them.
        self.set_grad_none = set_grad_none
        if not adamw_mode:  # L2 decay on the gradient (torch's Adam), not decoupled
            for group in self.param_groups:
                group["decoupled_weight_decay"] = False

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedSGD(torch.optim.SGD):
    """Colossal-AI's ``FusedSGD``: torch's SGD (fused or foreach kernels
    where it has them). ``wd_after_momentum=True`` is refused: torch adds
    the decay before the momentum."""

    def __init__(
        self,
        params: Any,
        lr: Any = required,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
    ) -> None:
        if wd_after_momentum:
            raise ValueError(
                "FusedSGD(wd_after_momentum=True): torch's SGD adds the weight decay to the "
                "gradient before the momentum; pass wd_after_momentum=False."
            )
        if lr is required:
            raise TypeError("FusedSGD: lr is required (as in Colossal-AI's).")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)  # fmt: skip


FusedLAMB = refused_class(
    _MODULE,
    "FusedLAMB",
    "pc has no counterpart of apex's fused LAMB kernel (decoupled decay, a clip by the global "
    "gradient norm inside the step). Use Lamb(bias_correction=True) from this module, with "
    "booster.clip_grad_by_norm for the clip.",
)
_DISTRIBUTED = (
    "Colossal-AI's optimizer for tensor-parallel and ZeRO shards; pc has no counterpart yet. "
    "Use torch.optim.AdamW or HybridAdam under any plugin"
)
DistributedLamb = refused_class(_MODULE, "DistributedLamb", _DISTRIBUTED + ".")
DistributedAdaFactor = refused_class(_MODULE, "DistributedAdaFactor", _DISTRIBUTED + ".")
DistributedCAME = refused_class(_MODULE, "DistributedCAME", _DISTRIBUTED + ".")
