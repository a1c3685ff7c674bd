"""The plugin choice of ``pc-train`` and ``pc-estimate``: a name and the
command-line options, mapped onto one plugin's options dataclass
(:meth:`PluginOptions.config`), whose rules decide what is accepted
[Note: one place for every rule]. What this module checks itself is only
which flags belong to which plugin."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from pc_booster.plugin import Plugin
from pc_booster.rules import PluginConfig, RunSetting, TrainPrecision

__all__ = [
    "LAYOUT_HELP",
    "PLUGIN_NAMES",
    "PP_STYLES",
    "RECOMPUTE",
    "SP_MODES",
    "LayoutOptions",
    "PluginKind",
    "PluginOptions",
    "add_layout_flags",
    "layout_field_type",
]


class PluginKind(Enum):
    DDP = "ddp"
    FSDP = "fsdp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    GEMINI = "gemini"
    HYBRID = "hybrid"


PLUGIN_NAMES = ("auto", *(kind.value for kind in PluginKind))
PRECISIONS = tuple(p.value for p in TrainPrecision)


# The plugins' rules speak of their options; pc-train's user sets flags.
_FLAGS = {
    "max_norm": "--clip-norm",
    "tp_size": "--tp",
    "pp_size": "--pp",
    "zero_stage": "--zero-stage",
    "num_microbatches": "--microbatches",
    "step_in_backward": "--step-in-backward",
    "enable_sequence_parallelism": "--sequence-parallel",
    "sp_size": "--sp",
    "ep_size": "--ep",
    "sequence_parallelism_mode": "--sp-mode",
    "offload_param_frac": "--offload-frac",
    "cpu_offload": "--cpu-offload",
    "no_sync": "--accumulation",
    "extra_dp_size": "--extra-dp",
    "activation_checkpointing": "--activation-checkpointing",
    "compile": "--compile",
    "optimizer_states": "--optimizer-states",
    "nvme_offload_fraction": "--nvme-offload-fraction",
    "nvme_offload_dir": "--nvme-offload-dir",
    "num_layers_per_stage": "--layers-per-stage",
    "pp_style": "--pp-style",
}
RECOMPUTE = ("none", "full", "selective")
# Pipeline schedules (pc_pipeline's): 1F1B, interleaved 1F1B (two model
# chunks per rank), zero bubble (backward split into input and weight parts).
PP_STYLES = ("1f1b", "interleaved", "zbv")
# How Adam's moments are stored (pc_offload [Note: low-precision optimizer states]).
OPTIMIZER_STATES = ("fp32", "bf16", "int8")
# Sequence parallelism of its own: Ulysses' all-to-all, or ring attention.
SP_MODES = ("all_to_all", "ring_attn")
NARROW_STATES = (PluginKind.ZERO1, PluginKind.ZERO2, PluginKind.GEMINI)


def _flags_named(message: str) -> str:
    """pc-train's flags for the plugin options a rule's message names."""
    named = [f"{name} is {flag}" for name, flag in _FLAGS.items() if name in message]
    return f" (in pc-train: {', '.join(named)})" if named else ""


@dataclass(frozen=True, kw_only=True)
class LayoutOptions:
    """The layout of a run beside the plugin's name: one name and one
    default each, shared by :class:`PluginOptions`, ``pc-train``'s
    ``TrainConfig`` (its flags and YAML keys) and ``pc-estimate``'s flags,
    which :func:`add_layout_flags` makes from these fields.

    - ``tp`` / ``pp``: tensor / pipeline parallel sizes (hybrid only).
    - ``zero_stage``: ZeRO over the data-parallel ranks of hybrid (0, 1, 2).
    - ``microbatches``: pipeline micro-batches (default: ``pp``).
    - ``sequence_parallel``: hybrid with tp > 1.
    - ``offload_frac``: Gemini's share of chunks kept on the host.
    - ``cpu_offload``: ZeRO-1/2 optimizer states and step on the host.
    - ``optimizer_states``: Adam's moments in fp32, bf16 or int8 (zero1,
      zero2, gemini for now).
    - ``nvme_offload_fraction`` / ``nvme_offload_dir``: that share of the
      moments the host steps in scratch files on local disk (zero1 / zero2
      with ``cpu_offload``, gemini with ``offload_frac``; pc_offload [Note:
      the NVMe tier]); default directory: the temporary one.
    - ``step_in_backward``: Gemini steps each chunk inside backward (12
      bytes per parameter of model states instead of 16).
    - ``sp`` / ``sp_mode``: sequence parallelism over ``sp`` ranks of its
      own (hybrid; ``all_to_all``: Ulysses).
    - ``ep``: expert parallelism (hybrid, mixture-of-experts models): each
      MoE block's experts split over ``ep`` data-parallel ranks.
    - ``tp`` with fsdp / gemini: ZeRO-3 over tensor parallelism.
    - ``extra_dp``: two-level sharding (zero1, zero2, gemini): sharded in
      ``extra_dp`` groups of consecutive ranks (a node's), replicated
      across them.
    - ``activation_checkpointing`` / ``activation_checkpointing_fraction``
      / ``compile``: every plugin's per-block recomputation and compile.
    - ``layers_per_stage``: hybrid with pp > 1, transformer blocks per
      stage, comma-separated (``"6,6,5"``; ``2 pp`` of them interleaved);
      None: an even split.
    - ``pp_style``: hybrid with pp > 1, the schedule: ``"1f1b"``,
      ``"interleaved"`` (two model chunks per rank) or ``"zbv"`` (zero
      bubble).
    """

    tp: int = 1
    pp: int = 1
    zero_stage: int = 1
    microbatches: int | None = None
    sequence_parallel: bool = False
    offload_frac: float = 0.0
    cpu_offload: bool = False
    optimizer_states: str = "fp32"
    nvme_offload_fraction: float = 0.0
    nvme_offload_dir: str | None = None
    step_in_backward: bool = False
    sp: int = 1
    sp_mode: str = "all_to_all"
    ep: int = 1
    extra_dp: int = 1
    activation_checkpointing: str = "none"
    activation_checkpointing_fraction: float = 1.0
    compile: bool = False
    layers_per_stage: str | None = None
    pp_style: str = "1f1b"


# One help text per layout field, for pc-train's and pc-estimate's flags.
LAYOUT_HELP = {
    "tp": "tensor-parallel size (hybrid; fsdp and gemini: ZeRO-3 over tensor parallelism)",
    "pp": "pipeline-parallel size (hybrid: GPT-2 and Llama)",
    "zero_stage": "ZeRO stage over the data-parallel ranks (hybrid: 0, 1, 2)",
    "microbatches": "pipeline micro-batches per step (default: pp)",
    "sequence_parallel": "hybrid with --tp: the norms and dropouts on 1/tp of the sequence",
    "offload_frac": "share of Gemini's chunks kept on the host",
    "cpu_offload": "ZeRO-1/2 optimizer step on the host",
    "optimizer_states": "Adam's moments stored as fp32, bf16 (half the bytes) or int8 "
    "(block-wise 8 bits, torchao's format; about a quarter); zero1, zero2, gemini",
    "nvme_offload_fraction": "share of the moments the host steps kept in scratch files on "
    "local disk, streamed through memory each step (zero1 / zero2 with --cpu-offload, gemini "
    "with --offload-frac)",
    "nvme_offload_dir": "the directory of those scratch files, on a local disk (default: the "
    "temporary directory); pc makes a private directory inside it and removes it at exit",
    "step_in_backward": "Gemini: step each chunk as soon as its gradients are reduced (12 "
    "bytes per parameter of model states instead of 16; needs --clip-norm 0, --accumulation 1 "
    "and fp32 or bf16)",
    "sp": "sequence-parallel size of its own (hybrid): each sequence split over sp ranks",
    "sp_mode": "sequence parallelism with --sp: all_to_all (Ulysses) or ring_attn (ring attention)",
    "ep": "expert-parallel size (hybrid, mixture-of-experts models such as mixtral-tiny): "
    "each MoE block's experts split over ep data-parallel ranks",
    "extra_dp": "two-level sharding (zero1, zero2, gemini): the model sharded in this many "
    "groups of consecutive ranks (a node's), replicated across them",
    "activation_checkpointing": "recompute each block's activations in backward: none, full, "
    "or selective (matrix products and attention kept, pointwise operations recomputed)",
    "activation_checkpointing_fraction": "the share of blocks (the first ones) recomputed",
    "compile": "torch.compile each transformer block (inductor)",
    "layers_per_stage": "transformer blocks on each pipeline stage, comma-separated (hybrid "
    "with --pp; default: an even split, which the blocks must allow)",
    "pp_style": "the pipeline schedule (hybrid with --pp): 1f1b, interleaved (two model chunks "
    "per rank, half the bubble; the stages divide the blocks 2 pp ways) or zbv (zero bubble: "
    "backward split into input and weight gradients)",
}
_CHOICES = {
    "optimizer_states": OPTIMIZER_STATES,
    "activation_checkpointing": RECOMPUTE,
    "pp_style": PP_STYLES,
    "sp_mode": SP_MODES,
}
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "int | None": int}


def layout_field_type(name: str) -> type:
    """The Python type of a layout field's values (None aside)."""
    found = {f.name: f.type for f in fields(LayoutOptions)}[name]
    return _TYPES.get(str(found), str)


def add_layout_flags(parser: argparse.ArgumentParser, *, suppress_defaults: bool) -> None:
    """A flag for each layout field (``--tp``, ``--cpu-offload``, ...):
    its type or choices, help and default from the field.
    ``suppress_defaults``: leave an unset flag out of the namespace (so a
    YAML file's value is not overridden by the default)."""
    for item in fields(LayoutOptions):
        flag = "--" + item.name.replace("_", "-")
        default = argparse.SUPPRESS if suppress_defaults else item.default
        text = f"{LAYOUT_HELP[item.name]} (default: {item.default})"
        kind = layout_field_type(item.name)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=default, help=text)
        elif item.name in _CHOICES:
            parser.add_argument(flag, choices=_CHOICES[item.name], default=default, help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)


@dataclass(frozen=True)
class PluginOptions(LayoutOptions):
    """One plugin and its layout (:class:`LayoutOptions`)."""

    kind: PluginKind

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    def _blocks_text(self) -> str:
        text = ""
        if self.activation_checkpointing != "none":
            share = self.activation_checkpointing_fraction
            text += f" recompute {self.activation_checkpointing}"
            text += f" {share:g}" if share != 1 else ""
        return text + (" compiled" if self.compile else "")

    def describe(self) -> str:
        if self.kind is not PluginKind.HYBRID:
            extra = f" tp{self.tp}" if self.tp > 1 else ""
            extra += f" x{self.extra_dp}" if self.extra_dp > 1 else ""
            extra += f" offload {self.offload_frac:g}" if self.offload_frac else ""
            extra += " cpu-offload" if self.cpu_offload else ""
            extra += f" {self.optimizer_states} states" if self.optimizer_states != "fp32" else ""
            extra += f" nvme {self.nvme_offload_fraction:g}" if self.nvme_offload_fraction else ""
            extra += " step-in-backward" if self.step_in_backward else ""
            return f"{self.name}{extra}{self._blocks_text()}"
        sp = " sp" if self.sequence_parallel else ""
        sp += f" {self.sp_mode} sp{self.sp}" if self.sp > 1 else ""
        sp += f" ep{self.ep}" if self.ep > 1 else ""
        sp += f" layers {self.layers_per_stage}" if self.layers_per_stage else ""
        sp += f" {self.pp_style}" if self.pp_style != "1f1b" else ""
        return f"hybrid tp{self.tp} pp{self.pp} zero{self.zero_stage}{sp}{self._blocks_text()}"

    def stage_split(self) -> tuple[int, ...] | None:
        """``layers_per_stage`` as numbers (None: an even split)."""
        if self.layers_per_stage is None:
            return None
        try:
            split = tuple(int(part) for part in self.layers_per_stage.split(","))
        except ValueError:
            raise ValueError(
                f"--layers-per-stage must be comma-separated block counts such as 6,6,5, got "
                f"{self.layers_per_stage!r}."
            ) from None
        return split

    @property
    def model_chunks(self) -> int:
        """Model chunks per pipeline rank: 2 interleaved, else 1."""
        return 2 if self.pp_style == "interleaved" and self.pp > 1 else 1

    def stage_blocks(self, layers: int) -> list[int]:
        """Transformer blocks on each pipeline stage (``pp`` x model chunks
        of them): the given split, else an even one; where the stages do
        not divide ``layers``, one more block on the middle stages (the
        first holds the embedding, the last the head), as Colossal-AI
        distributes them."""
        split = self.stage_split()
        if split is not None:
            return list(split)
        stages = self.pp * self.model_chunks
        base, extra = divmod(layers, stages)
        first = stages // 2 - extra // 2
        return [base + (first <= i < first + extra) for i in range(stages)]

    def rank_blocks(self, layers: int) -> list[int]:
        """Transformer blocks on each pipeline rank: its stage's, or, with
        interleaving, its two chunks' (stages ``i`` and ``i + pp``)."""
        blocks = self.stage_blocks(layers)
        if self.model_chunks == 1:
            return blocks
        return [blocks[i] + blocks[i + self.pp] for i in range(self.pp)]

    def flags(self) -> str:
        """The pc-train command-line options that select this plugin."""
        out = [f"--plugin {self.name}"]
        if self.kind is PluginKind.HYBRID:
            out += [f"--tp {self.tp}", f"--pp {self.pp}", f"--zero-stage {self.zero_stage}"]
            out += ["--sequence-parallel"] if self.sequence_parallel else []
            out += [f"--sp {self.sp}", f"--sp-mode {self.sp_mode}"] if self.sp > 1 else []
            out += [f"--ep {self.ep}"] if self.ep > 1 else []
            out += [f"--layers-per-stage {self.layers_per_stage}"] if self.layers_per_stage else []
            out += [f"--pp-style {self.pp_style}"] if self.pp_style != "1f1b" else []
        elif self.tp > 1:
            out.append(f"--tp {self.tp}")
        if self.extra_dp > 1:
            out.append(f"--extra-dp {self.extra_dp}")
        if self.activation_checkpointing != "none":
            out.append(f"--activation-checkpointing {self.activation_checkpointing}")
            if self.activation_checkpointing_fraction != 1:
                share = self.activation_checkpointing_fraction
                out.append(f"--activation-checkpointing-fraction {share:g}")
        if self.compile:
            out.append("--compile")
        if self.offload_frac:
            out.append(f"--offload-frac {self.offload_frac:g}")
        if self.cpu_offload:
            out.append("--cpu-offload")
        if self.optimizer_states != "fp32":
            out.append(f"--optimizer-states {self.optimizer_states}")
        if self.nvme_offload_fraction:
            out.append(f"--nvme-offload-fraction {self.nvme_offload_fraction:g}")
            if self.nvme_offload_dir is not None:
                out.append(f"--nvme-offload-dir {shlex.quote(self.nvme_offload_dir)}")
        if self.step_in_backward:
            out.append("--step-in-backward")
        return " ".join(out)

    def dp_size(self, world: int) -> int:
        """Ranks that read different batches (sequence-parallel ranks share one)."""
        return world // (self.model_parallel * self.sp)

    def config(self, max_norm: float = 0.0, timeout: float = 300.0) -> PluginConfig:
        """The plugin's own options dataclass for these flags.
        ``max_norm``: clipping (every plugin clips itself); ``timeout``:
        seconds a pipeline stage waits for its neighbour."""
        from pc_booster import plugins

        kind = self.kind
        blocks: dict[str, Any] = {
            "activation_checkpointing": self.activation_checkpointing,
            "activation_checkpointing_fraction": self.activation_checkpointing_fraction,
            "compile": self.compile,
        }
        if kind is PluginKind.DDP:
            return plugins.DDPOptions(max_norm=max_norm, **blocks)
        if kind is PluginKind.FSDP:
            return plugins.TorchFSDPOptions(max_norm=max_norm, tp_size=self.tp, **blocks)
        if kind in (PluginKind.ZERO1, PluginKind.ZERO2):
            stage = 1 if kind is PluginKind.ZERO1 else 2
            return plugins.LowLevelZeroOptions(
                stage=stage,
                cpu_offload=self.cpu_offload,
                optimizer_states=self.optimizer_states,
                nvme_offload_fraction=self.nvme_offload_fraction,
                nvme_offload_dir=self.nvme_offload_dir,
                max_norm=max_norm,
                extra_dp_size=self.extra_dp,
                **blocks,
            )
        if kind is PluginKind.GEMINI:
            return plugins.GeminiOptions(
                offload_param_frac=self.offload_frac,
                max_norm=max_norm,
                step_in_backward=self.step_in_backward,
                tp_size=self.tp,
                extra_dp_size=self.extra_dp,
                optimizer_states=self.optimizer_states,
                nvme_offload_fraction=self.nvme_offload_fraction,
                nvme_offload_dir=self.nvme_offload_dir,
                **blocks,
            )
        return plugins.HybridParallelOptions(
            **blocks,
            tp_size=self.tp,
            pp_size=self.pp,
            zero_stage=self.zero_stage,
            num_microbatches=self.microbatches,
            enable_sequence_parallelism=self.sequence_parallel or self.sp > 1,
            sequence_parallelism_mode=self.sp_mode if self.sp > 1 else None,
            sp_size=self.sp if self.sp > 1 else None,
            ep_size=self.ep,
            max_norm=max_norm,
            pp_timeout=timeout,
            num_layers_per_stage=self.stage_split(),
            pp_style=self.pp_style,
        )

    def check_flags(self) -> None:
        """Raise ValueError for a flag of another plugin than the one chosen."""
        for name in ("tp", "pp", "sp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}.")
        if self.ep > 1 and self.kind is not PluginKind.HYBRID:
            raise ValueError(f"--ep {self.ep} needs --plugin hybrid.")
        if self.sp > 1 and self.kind is not PluginKind.HYBRID:
            raise ValueError(f"--sp {self.sp} needs --plugin hybrid.")
        if self.sp > 1 and self.sequence_parallel:
            raise ValueError(
                "--sequence-parallel (Megatron's, inside tensor parallelism) and --sp "
                f"{self.sp} (--sp-mode {self.sp_mode}) do not combine yet; pass one of them."
            )
        three = (PluginKind.FSDP, PluginKind.GEMINI)  # ZeRO-3 over tensor parallelism
        if self.kind is not PluginKind.HYBRID and (
            self.pp > 1 or (self.tp > 1 and self.kind not in three)
        ):
            raise ValueError(
                f"--tp {self.tp} / --pp {self.pp}: --pp needs --plugin hybrid, --tp hybrid, "
                f"fsdp or gemini; {self.name} is data parallel only."
            )
        if self.extra_dp < 1:
            raise ValueError(f"--extra-dp must be at least 1, got {self.extra_dp}.")
        two_level = (PluginKind.ZERO1, PluginKind.ZERO2, PluginKind.GEMINI)
        if self.extra_dp > 1 and self.kind not in two_level:
            raise ValueError(
                f"--extra-dp {self.extra_dp} (two-level sharding) is an option of --plugin "
                "zero1 / zero2 / gemini."
            )
        if self.activation_checkpointing not in RECOMPUTE:
            raise ValueError(
                f"--activation-checkpointing must be one of {', '.join(RECOMPUTE)}, got "
                f"{self.activation_checkpointing!r}."
            )
        if not 0.0 <= self.offload_frac <= 1.0:
            raise ValueError(f"--offload-frac must be in [0, 1], got {self.offload_frac}.")
        if self.offload_frac and self.kind is not PluginKind.GEMINI:
            raise ValueError("--offload-frac is an option of --plugin gemini.")
        if self.cpu_offload and self.kind not in (PluginKind.ZERO1, PluginKind.ZERO2):
            raise ValueError("--cpu-offload is an option of --plugin zero1 / zero2.")
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise ValueError(
                f"--optimizer-states must be one of {', '.join(OPTIMIZER_STATES)}, got "
                f"{self.optimizer_states!r}."
            )
        if self.optimizer_states != "fp32" and self.kind not in NARROW_STATES:
            raise ValueError(
                f"--optimizer-states {self.optimizer_states}: moments stored narrow are built "
                f"for --plugin zero1 / zero2 / gemini so far, not {self.name}; use one of "
                "those, or --optimizer-states fp32."
            )
        if self.nvme_offload_fraction and self.kind not in NARROW_STATES:
            raise ValueError(
                f"--nvme-offload-fraction {self.nvme_offload_fraction:g}: the disk tier holds "
                f"the moments the host steps, under --plugin zero1 / zero2 (--cpu-offload) or "
                f"gemini (--offload-frac), not {self.name}; use one of those."
            )
        if self.step_in_backward and self.kind is not PluginKind.GEMINI:
            raise ValueError("--step-in-backward is an option of --plugin gemini.")
        if self.pp_style not in PP_STYLES:
            raise ValueError(
                f"--pp-style must be one of {', '.join(PP_STYLES)}, got {self.pp_style!r}."
            )
        if self.pp_style != "1f1b" and (self.kind is not PluginKind.HYBRID or self.pp < 2):
            raise ValueError(
                f"--pp-style {self.pp_style} is a schedule of --plugin hybrid --pp > 1."
            )
        if self.layers_per_stage is not None:
            if self.kind is not PluginKind.HYBRID:
                raise ValueError("--layers-per-stage is an option of --plugin hybrid (with --pp).")
            self.stage_split()  # parses, or names the bad value

    def check(
        self,
        world: int,
        precision: str,
        layers: int | None = None,
        *,
        max_norm: float = 0.0,
        accumulation: int | None = None,
        heads: int | None = None,
    ) -> None:
        """Raise ValueError for options that the plugin refuses for this run
        (the plugin's own rules) or flags that belong to another plugin."""
        if precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}.")
        self.check_flags()
        setting = RunSetting(
            world=world,
            precision=TrainPrecision.parse(precision),
            accumulation=accumulation,
            layers=layers,
            heads=heads,
        )
        message = self.config(max_norm).refusal(setting)
        if message is not None:
            raise ValueError(f"{self.describe()}: {message}{_flags_named(message)}")

    def make(self, max_norm: float, timeout: float = 300.0) -> Plugin:
        """The plugin (which clips by ``max_norm`` itself)."""
        self.check_flags()
        return self.config(max_norm, timeout).build()

    @staticmethod
    def parse(name: str, **options: Any) -> PluginOptions:
        if name == "auto":
            raise ValueError(
                "plugin 'auto' is a request, not a plugin: pc_train.train.prepare (which "
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
