"""The options of :class:`GeminiPlugin` (pc_booster.plugins.gemini), their
rules and their memory model."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import pc_offload
from pc_booster.rules import (
    EXTRA_DP_RULE,
    NVME_RULE,
    OPTIMIZER_STATES_RULE,
    LossScaleOptions,
    PluginConfig,
    Rule,
    RunSetting,
    StateBytes,
    TrainPrecision,
    tp_size_problem,
)

__all__ = ["GeminiOptions"]


def _placement(options: GeminiOptions, setting: RunSetting) -> str | None:
    if options.placement_policy not in ("static", "auto"):
        return f"placement_policy must be 'static' or 'auto', got {options.placement_policy!r}."
    return None


def _offload_fraction(options: GeminiOptions, setting: RunSetting) -> str | None:
    frac = options.offload_param_frac
    if not (isinstance(frac, int | float) and math.isfinite(frac) and 0.0 <= frac <= 1.0):
        return f"offload_param_frac is the share of chunks on the host, in [0, 1]; got {frac!r}."
    return None


def _in_backward_clipping(options: GeminiOptions, setting: RunSetting) -> str | None:
    if options.step_in_backward and options.max_norm > 0:
        return (
            f"step_in_backward=True steps each chunk before the others' gradients exist, so "
            f"max_norm={options.max_norm} cannot clip by the global norm; pass max_norm=0 or "
            "step_in_backward=False."
        )
    return None


def _in_backward_fp16(options: GeminiOptions, setting: RunSetting) -> str | None:
    if options.step_in_backward and setting.precision is TrainPrecision.FP16:
        return (
            "step_in_backward=True steps each chunk before the others' gradients exist, so an "
            "fp16 overflow could not skip the step; use bf16 or fp32, or step_in_backward=False."
        )
    return None


def _tensor_parallel(options: GeminiOptions, setting: RunSetting) -> str | None:
    tp = options.tp_size
    problem = tp_size_problem(tp, setting.world)
    if problem is not None:
        return problem
    if tp > 1 and options.extra_dp_size > 1:
        return (
            f"tp_size={tp} with extra_dp_size={options.extra_dp_size}: two-level sharding of "
            "tensor-parallel chunks is not built yet. Use one of them, or "
            "TorchFSDPPlugin(tp_size=...) over every data-parallel rank."
        )
    return None


def _in_backward_accumulation(options: GeminiOptions, setting: RunSetting) -> str | None:
    if options.step_in_backward and (setting.accumulation or 1) > 1:
        return (
            f"step_in_backward=True steps in every backward, so gradients cannot accumulate "
            f"over {setting.accumulation} micro-batches; use step_in_backward=False for "
            "accumulation, or one backward per step."
        )
    return None


@dataclass(frozen=True)
class GeminiOptions(PluginConfig, LossScaleOptions):
    """``placement_policy`` ``"static"`` (``offload_param_frac`` of the
    chunks on the host) or ``"auto"`` (within ``device_budget_bytes``);
    chunk size searched in ``search_range_m`` MiB from ``min_chunk_size_m``
    unless ``chunk_size`` is given; ``step_in_backward``: each chunk
    stepped as soon as its gradients are reduced (12 bytes per parameter of
    model states instead of 16); ``extra_dp_size``: two-level sharding, the
    chunks sharded in this many groups of consecutive ranks (a node's, with
    torchrun's numbering), each replicating the others ([Note: shards] in
    pc_chunk.chunk); 1 shards over every rank; ``tp_size``: tensor
    parallelism (pc-tensor's, as HybridParallelPlugin's) inside groups of
    that many consecutive ranks, the chunks of each rank's pieces sharded
    over the data-parallel ranks (Colossal-AI's argument); ``optimizer_states``:
    Adam's moments as "fp32", "bf16" or "int8" (pc_offload's state_dtype);
    ``nvme_offload_fraction`` / ``nvme_offload_dir``: that share of the
    host chunks' Adam moments in scratch files on local
    disk (pc_offload [Note: the NVMe tier]), as Colossal-AI's HybridAdam."""

    name: ClassVar[str] = "gemini"
    gathers_parameters: ClassVar[bool] = True
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "placement_policy other than 'static' or 'auto'",
            _placement,
            ({"placement_policy": "cuda"}, RunSetting()),
        ),
        Rule(
            "offload_param_frac outside [0, 1]",
            _offload_fraction,
            ({"offload_param_frac": 1.5}, RunSetting()),
        ),
        Rule(
            "step_in_backward with clipping (max_norm > 0)",
            _in_backward_clipping,
            ({"step_in_backward": True, "max_norm": 1.0}, RunSetting()),
        ),
        Rule(
            "step_in_backward with fp16",
            _in_backward_fp16,
            ({"step_in_backward": True}, RunSetting(precision=TrainPrecision.FP16)),
        ),
        Rule(
            "step_in_backward with gradient accumulation",
            _in_backward_accumulation,
            ({"step_in_backward": True}, RunSetting(accumulation=2)),
        ),
        EXTRA_DP_RULE,
        OPTIMIZER_STATES_RULE,
        NVME_RULE,
        Rule(
            "tp_size not dividing the ranks, or with extra_dp_size",
            _tensor_parallel,
            ({"tp_size": 3}, RunSetting(world=4)),
        ),
    )

    placement_policy: str = "static"
    offload_param_frac: float = 0.0
    device_budget_bytes: int | None = None
    chunk_size: int | None = None
    search_range_m: float = 32.0
    min_chunk_size_m: float = 32.0
    max_norm: float = 0.0
    prefetch: bool = True
    step_in_backward: bool = False
    force_outputs_fp32: bool = False
    verbose: bool = False
    enable_flash_attention: bool = False
    enable_fused_normalization: bool = False
    pin_memory: bool = False
    hidden_dim: int | None = None
    extra_dp_size: int = 1
    tp_size: int = 1
    optimizer_states: str = "fp32"
    nvme_offload_fraction: float = 0.0
    nvme_offload_dir: str | None = None
    HOST_STATES_HINT: ClassVar[str] = "set offload_param_frac > 0 (chunks on the host)"

    def states_on_host(self) -> bool:
        return self.host_fraction() > 0 or self.placement_policy == "auto"

    def host_fraction(self) -> float:
        """The share of chunks (shards and their optimizer states) on the host."""
        return self.offload_param_frac

    def flash_attention(self) -> bool:
        return self.enable_flash_attention

    def fused_normalization(self) -> bool:
        return self.enable_fused_normalization

    def describe(self) -> str:
        extra = f" offload {self.host_fraction():g}" if self.host_fraction() else ""
        replicas = f" x{self.extra_dp_size}" if self.extra_dp_size > 1 else ""
        replicas += f" tp{self.tp_size}" if self.tp_size > 1 else ""
        in_backward = " step-in-backward" if self.step_in_backward else ""
        states = f" {self.optimizer_states} states" if self.optimizer_states != "fp32" else ""
        states += f" nvme {self.nvme_offload_fraction:g}" if self.nvme_offload_fraction else ""
        return f"gemini{replicas}{extra}{in_backward}{states}"

    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        dp = max(dp // self.extra_dp_size, 1)  # sharded inside each group
        p = precision.bytes
        m = 0 if precision is TrainPrecision.FP32 else 4
        moments = 2 * pc_offload.moment_bytes(pc_offload.parse_state_dtype(self.optimizer_states))
        if self.step_in_backward:
            # The fp32 shard is parameter and master (the compute-dtype copy
            # exists only while gathered); no gradient shard is kept.
            states = StateBytes(4 * psi / dp, 0.0, 0.0, moments * psi / dp)
        else:
            states = StateBytes(p * psi / dp, p * psi / dp, m * psi / dp, moments * psi / dp)
        share = self.host_fraction()
        states = replace(states, host=share * states.total)
        return states.on_disk(self.nvme_offload_fraction, share)
