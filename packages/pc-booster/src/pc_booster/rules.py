"""What every plugin's options share: the run a plugin is asked to train
(:class:`RunSetting`), the rules that accept or refuse it (:class:`Rule`),
and the base of the frozen options dataclasses (:class:`PluginConfig`).

[Note: one place for every rule]
A plugin's options dataclass owns its rules as data (``RULES``): each rule
is a short summary (what the docs list) and a check returning the refusal's
message or None. ``validate`` runs them against what is known so far: the
plugin's constructor knows the options (and the world once torch.distributed
is up), ``Booster`` adds the precision, ``boost`` the model, ``no_sync`` the
accumulation; ``pc-train`` and ``pc-estimate`` know everything before any
process starts. They all call the same ``validate``, so a combination is
accepted or refused in exactly one place.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pc_booster.plugin import Plugin

__all__ = [
    "PluginConfig",
    "Rule",
    "RunSetting",
    "StateBytes",
    "TrainPrecision",
]


class TrainPrecision(Enum):
    """The precision a run trains in: the compute dtype; masters are fp32
    wherever a plugin keeps them."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @property
    def bytes(self) -> int:
        return 4 if self is TrainPrecision.FP32 else 2

    @staticmethod
    def parse(value: object) -> TrainPrecision:
        """``None`` / ``"fp32"`` / ``"bf16"`` / ``"fp16"`` or a torch dtype."""
        if value is None:
            return TrainPrecision.FP32
        if isinstance(value, TrainPrecision):
            return value
        if isinstance(value, torch.dtype):
            for precision in TrainPrecision:
                if precision.dtype == value:
                    return precision
        if isinstance(value, str):
            try:
                return TrainPrecision(value)
            except ValueError:
                pass
        raise ValueError(
            f"precision must be one of 'fp32', 'bf16', 'fp16' (or None for fp32), got {value!r}."
        )

    @staticmethod
    def of_model(dtype: torch.dtype | None) -> TrainPrecision | None:
        """The precision a model built in ``dtype`` asks for (None: not a
        floating dtype pc trains in)."""
        for precision in TrainPrecision:
            if precision.dtype == dtype:
                return precision
        return None


@dataclass(frozen=True)
class RunSetting:
    """What is known of a run when a rule is checked; None: not known yet
    (a rule that needs it passes for now and is checked again later).

    - ``world``: processes in the job.
    - ``precision``: the precision it trains in [Note: model dtype].
    - ``accumulation``: micro-batches per optimizer step.
    - ``model_dtype``: the floating dtype the model was built in.
    - ``layers`` / ``heads``: transformer blocks and attention heads.
    """

    world: int | None = None
    precision: TrainPrecision | None = None
    accumulation: int | None = None
    model_dtype: torch.dtype | None = None
    layers: int | None = None
    heads: int | None = None

    def with_(self, **changes: Any) -> RunSetting:
        return replace(self, **changes)


# [Note: model dtype]
# The precision a run trains in is the Booster's ``mixed_precision`` when
# given; otherwise the dtype the model was built in (a model built with
# ``torch_dtype=torch.bfloat16`` trains in bf16). Plugins that keep fp32
# masters initialise them from the values as built; plugins that keep none
# (DDP, hybrid with zero_stage=0) train fp32 only and refuse the others.


@dataclass(frozen=True)
class Rule:
    """One rule of a plugin's options. ``summary`` is the line the docs
    list; ``check(options, setting)`` returns the refusal's message (what
    was asked, why not, what to do instead) or None."""

    summary: str
    check: Callable[[Any, RunSetting], str | None]
    #: options and setting that break the rule, for the docs' example
    #: message (and a test that the rule does refuse them)
    example: tuple[dict[str, Any], RunSetting] = ({}, RunSetting())


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes per rank a plugin holds at the step (the ZeRO
    paper's accounting), and how many of them live on the host."""

    parameters: float
    gradients: float
    masters: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.masters + self.optimizer


def _finite_max_norm(options: Any, setting: RunSetting) -> str | None:
    value = getattr(options, "max_norm", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"max_norm must be a number (0 for no clipping), got {value!r}."
    if not math.isfinite(value) or value < 0:
        return f"max_norm must be finite and >= 0 (0 turns clipping off), got {value!r}."
    return None


def _accumulation_positive(options: Any, setting: RunSetting) -> str | None:
    if setting.accumulation is not None and setting.accumulation < 1:
        return f"accumulation must be at least 1, got {setting.accumulation}."
    return None


class PluginConfig(ABC):
    """Base of the plugins' frozen options dataclasses."""

    #: the plugin's name in pc-train (``--plugin``) and the docs
    name: ClassVar[str]
    #: rules every plugin has, then the subclass's own
    COMMON_RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "max_norm negative, infinite or NaN",
            _finite_max_norm,
            ({"max_norm": math.nan}, RunSetting()),
        ),
        Rule("accumulation below 1", _accumulation_positive, ({}, RunSetting(accumulation=0))),
    )
    RULES: ClassVar[tuple[Rule, ...]] = ()
    #: whether the plugin gathers sharded parameters in forward and backward
    gathers_parameters: ClassVar[bool] = False

    @classmethod
    def rules(cls) -> tuple[Rule, ...]:
        return (*cls.COMMON_RULES, *cls.RULES)

    def refusal(self, setting: RunSetting) -> str | None:
        """The first rule ``setting`` breaks, as its message; None if none."""
        for rule in self.rules():
            message = rule.check(self, setting)
            if message is not None:
                return message
        return None

    def validate(self, setting: RunSetting) -> None:
        """Raise ValueError naming the plugin if a rule refuses ``setting``."""
        message = self.refusal(setting)
        if message is not None:
            raise ValueError(f"{self.plugin_name()}: {message}")

    def plugin_name(self) -> str:
        return type(self).__name__.removesuffix("Options") + "Plugin"

    def model_parallel(self) -> int:
        """Ranks one model replica spans (tensor x pipeline)."""
        return 1

    def dp_size(self, world: int) -> int:
        return world // self.model_parallel()

    def describe(self) -> str:
        """Short human form, e.g. ``zero2`` or ``hybrid tp2 pp2 zero1``."""
        return self.name

    @abstractmethod
    def model_states(self, psi: float, dp: int, precision: TrainPrecision) -> StateBytes:
        """Bytes per rank for ``psi`` parameters of this rank's model part
        over ``dp`` data-parallel ranks, with Adam."""

    @abstractmethod
    def build(self) -> Plugin:
        """The plugin these options describe."""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


def example_message(config: type[PluginConfig], rule: Rule) -> str:
    """The message ``rule`` gives for its own example (AssertionError if
    the example does not break it: a rule and its docs must agree)."""
    changes, setting = rule.example
    message = rule.check(config(**changes), setting)
    assert message is not None, f"{config.__name__}: {rule.summary!r}'s example is accepted"
    return message


def rules_markdown(configs: Sequence[type[PluginConfig]]) -> str:
    """Every plugin's refusals with an example message, as markdown: the
    docs page ``plugin-rules.md`` is this text (tools/plugin_rules.py)."""
    lines = [
        "# What each plugin refuses",
        "",
        "Generated from the plugins' own rules by `python tools/plugin_rules.py`; do not",
        "edit by hand. The plugin's constructor, `Booster`, `boost`, `no_sync`, `pc-train` and",
        "`pc-estimate` all check these same rules, each as soon as it knows what a rule",
        "needs (see [the plugin guide](plugin-guide.md)). Every combination not refused",
        "here trains with the same losses and parameters as single-process training",
        "(the plugin matrix test).",
        "",
    ]
    for config in configs:
        plugin = config.__name__.removesuffix("Options") + "Plugin"
        lines += [
            f"## {plugin} (`{config.name}`)",
            "",
            "| refused | example message |",
            "|---|---|",
        ]
        for rule in config.rules():
            message = example_message(config, rule).replace("|", "\\|")
            lines.append(f"| {rule.summary} | {message} |")
        lines.append("")
    return "\n".join(lines)
