"""Adam optimizers that step where the fp32 master weights live.

[Note: master weights]
Each parameter has an fp32 master copy on the *step device*: the host for
:class:`CPUAdam` / :class:`CPUAdamW`, the parameter's own device for
:class:`HybridAdam`. An fp32 parameter already on the step device is its own
master (stepped in place, no copy). Otherwise the master is created from the
parameter at the first step, gradients are converted to fp32 on the step
device, the step runs there, and the parameter is refreshed from its master
(rounded to its dtype, copied back to its device). bf16/fp16 device copies
therefore never lose updates smaller than their precision.

[Note: the kernel]
The update is torch's fused Adam kernel (``torch._fused_adam_`` /
``torch._fused_adamw_``): one pass over parameter, gradient and both moments,
vectorised and spread over the intra-op threads. On the CPU it measures
faster than the multi-pass foreach implementation (see docs/benchmarks.md);
calling it directly skips torch.optim's per-step regrouping of tensors by
device and dtype, which we do once. The numbers are exactly those of
``torch.optim.AdamW(fused=True)``, and match the default implementation to
fp32 rounding. The kernel always corrects the moments' bias, so a group with
``bias_correction=False`` takes the same update
without the correction through foreach operations instead.

[Note: call shape]
``CPUAdam`` and ``HybridAdam`` take their arguments in the order of the
CPU Adams programs already call (DeepSpeed's shares the first six; the
compatibility edge's, docs/migrate-colossalai.md, all):
``(params, lr, bias_correction, betas, eps, weight_decay, adamw_mode,
nvme_offload_fraction, nvme_offload_dir)``, with decoupled weight decay
(AdamW) by default. ``amsgrad`` and ``maximize`` are keyword-only.
``CPUAdamW`` keeps torch's order ``(params, lr, betas, ...)``. A tuple
where ``bias_correction`` goes is a torch-ordered call and
is refused rather than read as a flag.

State entries are named as torch's (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), plus ``master`` where the parameter is not its own
master, so a state dict of fp32 host parameters loads into
``torch.optim.AdamW`` and back.

[Note: DTensor parameters]
Parameters sharded by torch's FSDP2 (``fully_shard``) or tensor parallelism
are DTensors, and so are their gradients. Adam is element-wise, so each
rank steps only its local shard: the kernel gets the local tensors (the
same storage: the DTensor sees the update), never a mix of DTensors and
plain tensors, which DTensor dispatch refuses. The master and the moments
are kept as DTensors laid out as the parameter (their local tensors on
the step device), as torch's optimizers keep them, so
``torch.distributed.checkpoint``'s state dicts gather and reshard them
like the parameter. ``step`` stays a plain scalar, as in torch.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from pc_offload import states
from pc_offload.nvme import NvmeTier
from pc_offload.states import StateDtype, parse_state_dtype

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
else:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4 keeps it private
        from torch.distributed._tensor import DTensor

__all__ = ["CPUAdam", "CPUAdamW", "HybridAdam"]

_HOST = torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: in-place updates reach the
    DTensor); any other tensor itself [Note: DTensor parameters]. Called
    without grad, so no autograd node is made."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A state tensor for ``param`` from its local values: a DTensor laid
    out as ``param`` when it is one [Note: DTensor parameters]."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The part of ``grad`` that matches ``param``'s local shard."""
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        raise TypeError(
            "CPUAdam/HybridAdam: a parameter and its gradient must both be DTensors or both "
            f"plain tensors; got a {type(param).__name__} parameter with a "
            f"{type(grad).__name__} gradient."
        )
    if (
        isinstance(param, DTensor)
        and isinstance(grad, DTensor)
        and grad.placements != param.placements
    ):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(grad)


class _MasterAdam(Optimizer):
    """Adam/AdamW over fp32 masters on a step device [Note: master weights]."""

    # Host masters (CPUAdam, CPUAdamW) or masters where each parameter lives
    # (HybridAdam); a class constant, as the step device is what the class is.
    _on_host: bool = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        *,
        amsgrad: bool,
        maximize: bool,
        decoupled: bool,
        bias_correction: bool,
        state_dtype: str | torch.dtype | StateDtype = "fp32",
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        bf16_stochastic_round: bool = False,
    ) -> None:
        # How the moments are stored [Note: low-precision optimizer states].
        self.state_dtype = parse_state_dtype(state_dtype)
        # bf16 parameters are their own masters, rounded stochastically (or
        # have bf16 host masters) instead of fp32 masters [same note].
        if not isinstance(bf16_stochastic_round, bool):
            raise TypeError(
                f"bf16_stochastic_round must be True or False, got {bf16_stochastic_round!r}."
            )
        self.bf16_stochastic_round = bf16_stochastic_round
        states.check_available(self.state_dtype)
        # The disk tier [Note: the NVMe tier in pc_offload.nvme]: the share
        # of the parameters (by elements, in order) whose states live there.
        if not 0.0 <= nvme_offload_fraction <= 1.0:
            raise ValueError(
                f"nvme_offload_fraction must be in [0, 1], got {nvme_offload_fraction}."
            )
        self.nvme_offload_fraction = float(nvme_offload_fraction)
        self.nvme: NvmeTier | None = None
        if self.nvme_offload_fraction > 0.0:
            self.nvme = NvmeTier(nvme_offload_dir or tempfile.gettempdir())
        # Each parameter's place (by id), and the elements seen and placed.
        self._disk_of: dict[int, bool] = {}
        self._seen_numel = self._placed_numel = 0
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr} (must be >= 0).")
        if eps < 0.0:
            raise ValueError(f"invalid eps: {eps} (must be >= 0).")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas} (each must be in [0, 1)).")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay} (must be >= 0).")
        # Decoupled (AdamW) or L2 (Adam) weight decay, for every group: one
        # optimizer is one algorithm (``adamw_mode`` chooses the decay).
        self._decoupled = decoupled
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "bias_correction": bias_correction,
            # Recorded in checkpoints; the format this optimizer stores.
            "state_dtype": self.state_dtype.value,
            # Kept with the hyperparameters so that an optimizer rebuilt from
            # them (a plugin's, over its shards) keeps its disk tier.
            "nvme_offload_fraction": self.nvme_offload_fraction,
            "nvme_offload_dir": nvme_offload_dir,
            "bf16_stochastic_round": bf16_stochastic_round,
        }
        super().__init__(params, defaults)

    def _step_device(self, param: torch.Tensor) -> torch.device:
        return _HOST if self._on_host else param.device

    def _own_master(self, param: torch.Tensor) -> bool:
        """An fp32 parameter on the step device is stepped in place, and so
        is a bf16 one under ``bf16_stochastic_round``."""
        return param.dtype == self._master_dtype(param) and param.device == self._step_device(param)

    def _master_dtype(self, param: torch.Tensor) -> torch.dtype:
        """fp32, or bf16 for a bf16 parameter under ``bf16_stochastic_round``."""
        if self.bf16_stochastic_round and param.dtype == torch.bfloat16:
            return torch.bfloat16
        return torch.float32

    def _init_state(self, param: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        """``param``'s state, created at its first step. With a DTensor
        parameter every tensor but ``step`` is a DTensor laid out as it
        [Note: DTensor parameters]."""
        state: dict[str, Any] = self.state[param]
        if state:
            self._restore_format(param, state)
            self._restore_placement(param, state)
            if amsgrad and "max_exp_avg_sq" not in state:
                master = _local(state["master"]) if "master" in state else _local(param)
                zeros = states.zeros(master, self.state_dtype, signed=False)
                state["max_exp_avg_sq"] = _like(param, zeros)
            return state
        device = self._step_device(param)
        local = _local(param).detach()
        if self._own_master(param):
            master = local
        else:
            master = self._master_of(local, device)
            state["master"] = _like(param, master)
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for key in ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if amsgrad else ())):
            zeros = states.zeros(master, self.state_dtype, signed=key == "exp_avg")
            state[key] = _like(param, zeros)
        self._restore_placement(param, state)
        return state

    def _disk(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s states live on the NVMe tier, decided when its
        states are first made: there when that brings the elements placed
        closer to the fraction of all seen so far (every one at 1.0; within
        a tensor of the fraction otherwise). Decided as they come, not from
        the groups' sizes up front: a plugin's shard parameters may be
        empty until their chunk is first used. Only states stepped on the
        host go there (HybridAdam steps a device parameter on its device,
        with its states beside it, as Colossal-AI's does)."""
        if self.nvme is None or self._step_device(param).type != "cpu":
            return False
        decided = self._disk_of.get(id(param))
        if decided is None:
            numel = _local(param).numel()
            self._seen_numel += numel
            target = self.nvme_offload_fraction * self._seen_numel
            placed = self._placed_numel
            decided = abs(placed + numel - target) <= abs(placed - target)
            self._placed_numel += numel if decided else 0
            self._disk_of[id(param)] = decided
        return decided

    def _restore_placement(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """States of a parameter placed on the NVMe tier live there (made,
        loaded or widened in memory, they move at its next step)."""
        if self.nvme is None or not self._disk(param):
            return
        for key in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            value = state.get(key)
            if value is None:
                continue
            local = _local(value)
            if hasattr(local, "codes") or self.nvme.holds(local):  # 8-bit: small, in memory
                continue
            placed = self.nvme.empty(local.shape, local.dtype)
            placed.copy_(local)
            state[key] = _like(param, placed)

    def _restore_format(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Moments in fp32 where this optimizer stores them narrow (widened
        for a checkpoint's pieces, pc_zero) go back to its format
        [Note: low-precision optimizer states]."""
        if self.state_dtype is StateDtype.FP32:
            return
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            value = state.get(key)
            if value is None or states.is_narrow(_local(value)):
                continue
            stored = states.store(_local(value), self.state_dtype, signed=key == "exp_avg")
            if stored is not _local(value):
                state[key] = _like(param, stored)

    def _master_of(self, local: torch.Tensor, device: torch.device) -> torch.Tensor:
        """An fp32 (or bf16, [Note: low-precision optimizer states]) copy of
        a (local) parameter on the step device."""
        pin = device.type == "cpu" and local.is_cuda
        dtype = self._master_dtype(local)
        master = torch.empty(local.shape, dtype=dtype, device=device, pin_memory=pin)
        master.copy_(local.detach())
        return master

    def _positions(self) -> dict[int, int]:
        """Each bf16 master's position among the optimizer's parameters (by
        its storage), which seeds its rounding's random bits."""
        found: dict[int, int] = {}
        position = 0
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param, {})
                master = state.get("master", param)
                found[_local(master).untyped_storage().data_ptr()] = position
                position += 1
        return found

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.nvme is not None:
            self.nvme.wait()  # the last step's write-behind, and its errors
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        amsgrad = bool(group["amsgrad"])
        by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
        refresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Tensors whose moments are stored narrow, stepped block by block
        # [Note: low-precision optimizer states].
        narrow: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]] = []
        crosses = False  # a device parameter stepped through a host master
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("CPUAdam/HybridAdam do not support sparse gradients.")
            state = self._init_state(param, amsgrad)
            # The kernel sees local shards only [Note: DTensor parameters].
            local = _local(param)
            master = _local(state["master"]) if "master" in state else local
            grad = _local_grad(param, param.grad)
            if grad.dtype != torch.float32 or grad.device != master.device:
                grad = grad.to(device=master.device, dtype=torch.float32, non_blocking=True)
            if master is not local:
                refresh.append((local, master))
                crosses = crosses or (local.is_cuda and not master.is_cuda)
            narrow_master = master.dtype != torch.float32
            if narrow_master or states.is_narrow(_local(state["exp_avg"])) or self._disk(param):
                keys = ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if amsgrad else ()))
                narrow.append((master, grad, [_local(state[k]) for k in keys], state["step"]))
                continue
            lists = by_device.setdefault(master.device, [[], [], [], [], [], []])
            lists[0].append(master)
            lists[1].append(grad)
            lists[2].append(_local(state["exp_avg"]))
            lists[3].append(_local(state["exp_avg_sq"]))
            if amsgrad:
                lists[4].append(_local(state["max_exp_avg_sq"]))
            lists[5].append(state["step"])
        if crosses:
            # The host kernel must not start before this step's asynchronous
            # device-to-host gradient copies have landed, nor overwrite a
            # master that last step's host-to-device refresh still reads.
            torch.cuda.synchronize()
        update = self._fused_step if group["bias_correction"] else self._uncorrected_step
        for lists in by_device.values():
            torch._foreach_add_(lists[5], 1)
            update(group, *lists)
        tier = self.nvme  # [Note: the NVMe tier]
        # bf16 masters' positions seed their rounding: found once a step.
        positions = self._positions() if any(m.dtype != torch.float32 for m, *_ in narrow) else {}
        for i, (master, grad, moments, step) in enumerate(narrow):
            if tier is not None:
                if i + 1 < len(narrow):
                    tier.read_ahead([narrow[i + 1][0], *narrow[i + 1][2]])
                tier.ready([master, *moments])
            step.add_(1)
            if master.dtype != torch.float32:  # bf16, rounded stochastically
                position = positions[master.untyped_storage().data_ptr()]
                rounding = states.rounding_generator(master.device, int(step), position)
                kernel = partial(update, group)
                states.step_blockwise(kernel, master, grad, moments, step, rounding)
            elif states.is_narrow(moments[0]):
                states.step_blockwise(partial(update, group), master, grad, moments, step)
            else:
                update(group, [master], [grad], moments[:1], moments[1:2], moments[2:], [step])
            if tier is not None:
                tier.write_behind([master, *moments])
        if tier is not None and narrow:
            # The next step's first tensor, read while the next forward and
            # backward compute.
            tier.read_ahead([narrow[0][0], *narrow[0][2]])
        for local, master in refresh:
            local.copy_(master, non_blocking=True)

    def _fused_step(
        self,
        group: dict[str, Any],
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        """One bias-corrected step of tensors on one device [Note: the kernel]."""
        kernel = torch._fused_adamw_ if self._decoupled else torch._fused_adam_
        beta1, beta2 = group["betas"]
        kernel(
            masters,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            amsgrad=bool(group["amsgrad"]),
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            maximize=bool(group["maximize"]),
            grad_scale=None,
            found_inf=None,
        )

    def _uncorrected_step(
        self,
        group: dict[str, Any],
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        """The kernel's update without bias correction (``bias_correction=
        False``): ``m / (sqrt(v) + eps)`` times ``lr``, the step count unused.
        ``grads`` may be the parameters' own gradients: never written."""
        del steps  # counted by the caller; the uncorrected update ignores it
        lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
        if decay != 0.0:
            if self._decoupled:
                torch._foreach_mul_(masters, 1.0 - lr * decay)
            else:
                grads = list(torch._foreach_add(grads, masters, alpha=decay))
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        second = exp_avg_sqs
        if group["amsgrad"]:
            torch._foreach_maximum_(max_sqs, exp_avg_sqs)
            second = max_sqs
        denoms = torch._foreach_sqrt(second)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(masters, exp_avgs, denoms, value=-lr)

    def state_dict(self) -> dict[str, Any]:
        """torch's, with the moments in fp32 whatever their storage, and each
        group's ``state_dtype`` [Note: low-precision optimizer states]."""
        saved: dict[str, Any] = super().state_dict()
        saved["state"] = {k: dict(v) for k, v in saved["state"].items()}  # not ours to change
        for entry in saved["state"].values():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and states.is_narrow(_local(value)):
                    entry[key] = _like(value, states.widen(_local(value)))
        return saved

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but moment and master tensors keep fp32 on the step
        device (torch would cast them to each parameter's dtype, which for a
        bf16 parameter throws away the bits the master exists to keep), laid
        out as the parameter when it is a DTensor [Note: DTensor parameters].
        Saved parameters are matched to ours by position, as torch does
        (their keys are indices, or names in ``torch.distributed.checkpoint``'s
        state dicts)."""
        saved = state_dict["state"]
        saved_keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for group in self.param_groups:
            # A state dict from torch's Adam, or from before an option
            # existed, lacks this optimizer's extra keys: take the defaults.
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            # The format is this optimizer's, not the checkpoint's: a state
            # saved in another loads into it [Note: low-precision optimizer states].
            group["state_dtype"] = self.state_dtype.value
        for saved_key, param in zip(saved_keys, params, strict=True):
            if saved_key not in saved:
                continue
            state = self.state[param]
            for key, value in saved[saved_key].items():
                if key == "master" and self._own_master(param):
                    # Saved by an optimizer with separate masters: this one
                    # steps the parameter itself, loaded with the model.
                    state.pop(key, None)
                    continue
                if isinstance(value, torch.Tensor):
                    state[key] = self._loaded(param, key, value)
            if "master" not in state and not self._own_master(param):
                master = self._master_of(_local(param), self._step_device(param))
                state["master"] = _like(param, master)

    def _loaded(self, param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """A saved state tensor as this optimizer keeps it: fp32, on the step
        device, a DTensor like ``param`` when it is one (``step`` a plain
        scalar)."""
        dtype = self._master_dtype(param) if key == "master" else torch.float32
        local = _local(value).detach().to(device=self._step_device(param), dtype=dtype)
        local = local.clone()
        if key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            local = states.store(local, self.state_dtype, signed=key == "exp_avg")
        if key == "step" or not isinstance(param, DTensor):
            return local
        if local.shape != _local(param).shape:
            raise ValueError(
                f"CPUAdam/HybridAdam: saved state {key!r} has shape {tuple(local.shape)}, but "
                f"this rank's shard of the DTensor parameter is {tuple(_local(param).shape)}. "
                "Load sharded state through torch.distributed.checkpoint.state_dict."
                "set_optimizer_state_dict, which lays it out as the parameters."
            )
        return _like(param, local)


def _check_flag(name: str, bias_correction: object) -> bool:
    """``bias_correction`` as passed, refusing a torch-ordered call that put
    ``betas`` there [Note: call shape]."""
    if not isinstance(bias_correction, bool):
        raise TypeError(
            f"{name}: expected a bool for bias_correction (the third positional argument), got "
            f"{bias_correction!r}. {name} takes the CPU Adam order (params, lr, "
            "bias_correction, betas, eps, weight_decay, adamw_mode); pass betas=... by keyword."
        )
    return bias_correction


class CPUAdam(_MasterAdam):
    """AdamW (``adamw_mode=True``, the default, as DeepSpeed's CPU Adam) or
    Adam with L2 weight decay (``adamw_mode=False``, as ``torch.optim.Adam``),
    with fp32 master weights and optimizer states in host memory. Arguments
    in the CPU Adam order [Note: call shape]; ``bias_correction=False`` drops
    the moments' bias correction.
    ``nvme_offload_fraction`` of the parameters (by elements, the first in
    order) keep their states (moments, and masters where separate) in
    scratch files in ``nvme_offload_dir`` (default: the temporary
    directory) [Note: the NVMe tier in pc_offload.nvme].
    ``state_dtype`` (``"fp32"``, ``"bf16"``, ``"int8"``) is how the moments
    are stored [Note: low-precision optimizer states]."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        state_dtype: str | torch.dtype | StateDtype = "fp32",
        bf16_stochastic_round: bool = False,
    ) -> None:
        name = type(self).__name__
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled=adamw_mode,
            bias_correction=_check_flag(name, bias_correction),
            state_dtype=state_dtype,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
            bf16_stochastic_round=bf16_stochastic_round,
        )


class CPUAdamW(_MasterAdam):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``, whose
    argument order it keeps) with fp32 master weights and optimizer states
    in host memory, stored as ``state_dtype`` (``"fp32"``, ``"bf16"``,
    ``"int8"``) [Note: low-precision optimizer states]; ``nvme_offload_*``
    as :class:`CPUAdam`'s."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        bias_correction: bool = True,
        state_dtype: str | torch.dtype | StateDtype = "fp32",
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        bf16_stochastic_round: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled=True,
            bias_correction=bias_correction,
            state_dtype=state_dtype,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
            bf16_stochastic_round=bf16_stochastic_round,
        )


class HybridAdam(CPUAdam):
    """:class:`CPUAdam`'s arguments and arithmetic, stepping every parameter
    where it lives: device-resident ones with the fused kernel on the
    device, host-resident ones on the host, in one optimizer."""

    _on_host = False
