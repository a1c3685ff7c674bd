"""The plugin choice of ``pc-train`` and ``pc-estimate``: a name and its
options, validated against a world size before any process starts, and
turned into a :class:`~pc_booster.Plugin`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from pc_booster.plugin import Plugin

__all__ = ["PLUGIN_NAMES", "PluginKind", "PluginOptions"]


class PluginKind(Enum):
    DDP = "ddp"
    FSDP = "fsdp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    GEMINI = "gemini"
    HYBRID = "hybrid"


PLUGIN_NAMES = ("auto", *(kind.value for kind in PluginKind))
PRECISIONS = ("fp32", "bf16", "fp16")

# What each plugin accepts: (plugin, precision) pairs the plugins refuse.
_PRECISIONS: dict[PluginKind, tuple[str, ...]] = {
    PluginKind.DDP: ("fp32",),
    PluginKind.FSDP: ("fp32", "bf16"),
    PluginKind.ZERO1: PRECISIONS,
    PluginKind.ZERO2: PRECISIONS,
    PluginKind.GEMINI: PRECISIONS,
    PluginKind.HYBRID: PRECISIONS,  # with zero_stage >= 1; fp32 only with 0
}


@dataclass(frozen=True)
class PluginOptions:
    """One plugin and the options ``pc-train`` exposes for it.

    - ``tp`` / ``pp``: tensor / pipeline parallel sizes (hybrid only).
    - ``zero_stage``: ZeRO over the data-parallel ranks of hybrid (0, 1, 2).
    - ``microbatches``: pipeline micro-batches (default: ``pp``).
    - ``sequence_parallel``: hybrid with tp > 1.
    - ``offload_frac``: Gemini's share of chunks kept on the host.
    - ``cpu_offload``: ZeRO-1/2 optimizer states and step on the host.
    - ``step_in_backward``: Gemini steps each chunk inside backward (12
      bytes per parameter of model states instead of 16).
    """

    kind: PluginKind
    tp: int = 1
    pp: int = 1
    zero_stage: int = 1
    microbatches: int | None = None
    sequence_parallel: bool = False
    offload_frac: float = 0.0
    cpu_offload: bool = False
    step_in_backward: bool = False

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        if self.kind is not PluginKind.HYBRID:
            extra = f" offload {self.offload_frac:g}" if self.offload_frac else ""
            extra += " cpu-offload" if self.cpu_offload else ""
            extra += " step-in-backward" if self.step_in_backward else ""
            return f"{self.name}{extra}"
        sp = " sp" if self.sequence_parallel else ""
        return f"hybrid tp{self.tp} pp{self.pp} zero{self.zero_stage}{sp}"

    def flags(self) -> str:
        """The pc-train command-line options that select this plugin."""
        out = [f"--plugin {self.name}"]
        if self.kind is PluginKind.HYBRID:
            out += [f"--tp {self.tp}", f"--pp {self.pp}", f"--zero-stage {self.zero_stage}"]
            out += ["--sequence-parallel"] if self.sequence_parallel else []
        if self.offload_frac:
            out.append(f"--offload-frac {self.offload_frac:g}")
        if self.cpu_offload:
            out.append("--cpu-offload")
        if self.step_in_backward:
            out.append("--step-in-backward")
        return " ".join(out)

    def dp_size(self, world: int) -> int:
        return world // self.model_parallel

    def check(self, world: int, precision: str, layers: int | None = None) -> None:
        """Raise ValueError for options that do not fit ``world`` ranks."""
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}.")
        if self.kind is not PluginKind.HYBRID and self.model_parallel > 1:
            raise ValueError(
                f"--tp {self.tp} / --pp {self.pp} need --plugin hybrid; {self.name} is data "
                "parallel only."
            )
        if world % self.model_parallel:
            raise ValueError(
                f"tp ({self.tp}) x pp ({self.pp}) = {self.model_parallel} does not divide the "
                f"world size ({world}); choose sizes whose product divides the number of "
                "processes (--nproc, or torchrun's)."
            )
        if precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}.")
        allowed = _PRECISIONS[self.kind]
        if self.kind is PluginKind.HYBRID and self.zero_stage == 0:
            allowed = ("fp32",)
        if precision not in allowed:
            raise ValueError(
                f"{self.describe()} trains in {' / '.join(allowed)}, not {precision}; use "
                "--precision fp32, or a ZeRO plugin (zero1, zero2, gemini) for mixed precision."
            )
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"--zero-stage must be 0, 1 or 2, got {self.zero_stage}.")
        if self.kind is PluginKind.HYBRID and self.pp > 1:
            if self.zero_stage == 2:
                raise ValueError("--pp > 1 works with --zero-stage 0 or 1, not 2.")
            if self.sequence_parallel:
                raise ValueError("--sequence-parallel needs --pp 1.")
            if layers is not None and layers % self.pp:
                raise ValueError(
                    f"the model's {layers} layers do not split into --pp {self.pp} stages; "
                    "choose a pp that divides the number of layers."
                )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tp > 1.")
        if not 0.0 <= self.offload_frac <= 1.0:
            raise ValueError(f"--offload-frac must be in [0, 1], got {self.offload_frac}.")
        if self.offload_frac and self.kind is not PluginKind.GEMINI:
            raise ValueError("--offload-frac is an option of --plugin gemini.")
        if self.cpu_offload and self.kind not in (PluginKind.ZERO1, PluginKind.ZERO2):
            raise ValueError("--cpu-offload is an option of --plugin zero1 / zero2.")
        if self.step_in_backward and self.kind is not PluginKind.GEMINI:
            raise ValueError("--step-in-backward is an option of --plugin gemini.")
        if self.step_in_backward and precision == "fp16":
            raise ValueError(
                "--step-in-backward steps each chunk before the others' gradients exist, so an "
                "fp16 overflow could not skip the step; use --precision bf16 or fp32."
            )

    def make(self, max_norm: float, timeout: float = 300.0) -> tuple[Plugin, float]:
        """The plugin, and the clipping norm the training loop must apply
        itself (plugins that clip inside their optimizer get ``max_norm``).
        ``timeout``: seconds a pipeline stage waits for its neighbour."""
        from pc_booster import plugins

        kind = self.kind
        if kind is PluginKind.DDP:
            return plugins.DDPPlugin(), max_norm
        if kind is PluginKind.FSDP:
            return plugins.TorchFSDPPlugin(), max_norm
        if kind in (PluginKind.ZERO1, PluginKind.ZERO2):
            stage = 1 if kind is PluginKind.ZERO1 else 2
            zero = plugins.LowLevelZeroPlugin(
                stage, cpu_offload=self.cpu_offload, max_norm=max_norm
            )
            return zero, 0.0
        if kind is PluginKind.GEMINI:
            if self.step_in_backward and max_norm:
                raise ValueError(
                    f"--step-in-backward steps each chunk before the others' gradients exist, "
                    f"so it cannot clip by the global norm (--clip-norm {max_norm:g}); pass "
                    "--clip-norm 0 with it."
                )
            gemini = plugins.GeminiPlugin(
                offload_param_frac=self.offload_frac,
                max_norm=max_norm,
                step_in_backward=self.step_in_backward,
            )
            return gemini, 0.0
        if max_norm and (self.tp > 1 or self.pp > 1) and self.zero_stage == 0:
            raise ValueError(
                "clipping across tensor or pipeline shards is done by the ZeRO optimizer; use "
                "--zero-stage 1 with --plugin hybrid, or --clip-norm 0."
            )
        if max_norm and self.pp > 1:
            raise ValueError(
                "gradient clipping with pipeline stages is not supported yet (each stage "
                "would clip by its own norm); use --clip-norm 0 with --pp > 1."
            )
        hybrid = plugins.HybridParallelPlugin(
            tp_size=self.tp,
            pp_size=self.pp,
            zero_stage=self.zero_stage,
            num_microbatches=self.microbatches,
            enable_sequence_parallelism=self.sequence_parallel,
            max_norm=max_norm if self.zero_stage else 0.0,
            pp_timeout=timeout,
        )
        return hybrid, 0.0 if self.zero_stage else max_norm

    @staticmethod
    def parse(name: str, **options: Any) -> PluginOptions:
        if name == "auto":
            raise ValueError(
                "plugin 'auto' is a request, not a plugin: pc_booster.train.prepare (which "
                "pc-train runs first) replaces it with pc-estimate's choice. Call prepare, or "
                f"name one of {', '.join(n for n in PLUGIN_NAMES if n != 'auto')}."
            )
        try:
            kind = PluginKind(name)
        except ValueError:
            raise ValueError(
                f"unknown plugin {name!r}; expected one of {', '.join(PLUGIN_NAMES)}."
            ) from None
        return PluginOptions(kind, **options)
