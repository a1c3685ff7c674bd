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

import difflib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pc_offload import StateDtype, parse_state_dtype
from pc_zero import LossScaleConfig

if TYPE_CHECKING:
    from pc_booster.plugin import Plugin

__all__ = [
    "EXTRA_DP_RULE",
    "NVME_RULE",
    "OPTIMIZER_STATES_RULE",
    "RECOMPUTE",
    "BlockOptions",
    "LossScaleOptions",
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
    def parse(value: object, what: str = "precision") -> TrainPrecision:
        """``None`` / ``"fp32"`` / ``"bf16"`` / ``"fp16"`` or a torch dtype:
        the one parser of a precision (``what``: the argument, for errors)."""
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
        raise ValueError(f"{what} must be 'fp16', 'bf16', 'fp32' or None, got {value!r}.")

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


def _extra_dp(options: Any, setting: RunSetting) -> str | None:
    extra = options.extra_dp_size
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 1:
        return f"extra_dp_size must be an int >= 1, got {extra!r}."
    if setting.world is not None and setting.world % extra:
        return (
            f"extra_dp_size={extra} must divide the {setting.world} ranks (it is the number of "
            "groups the model is sharded in, each replicating the others); choose a divisor."
        )
    return None


#: Two-level sharding's rule, shared by the plugins that take ``extra_dp_size``.
EXTRA_DP_RULE = Rule(
    "extra_dp_size not dividing the ranks", _extra_dp, ({"extra_dp_size": 3}, RunSetting(world=4))
)


def _optimizer_states(options: Any, setting: RunSetting) -> str | None:
    try:
        parse_state_dtype(options.optimizer_states)
    except ValueError as error:
        return f"optimizer_states: {error}"
    return None


#: The rule of ``optimizer_states`` (Adam's moments in fp32, bf16 or 8
#: bits; pc_offload [Note: low-precision optimizer states]), shared by the
#: plugins that take it.
OPTIMIZER_STATES_RULE = Rule(
    "optimizer_states other than fp32, bf16 or int8",
    _optimizer_states,
    ({"optimizer_states": "fp8"}, RunSetting()),
)


def tp_size_problem(tp: object, world: int | None) -> str | None:
    """What is wrong with a ``tp_size`` on ``world`` ranks, or None (the
    check the plugins taking it share)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return f"tp_size must be an int >= 1, got {tp!r}."
    if world is not None and world % tp:
        return f"tp_size={tp} must divide the {world} ranks; choose a divisor."
    return None


def _is_int8(states: object) -> bool:
    try:
        return parse_state_dtype(states) is StateDtype.INT8  # type: ignore[arg-type]
    except ValueError:
        return False  # OPTIMIZER_STATES_RULE names it


def _nvme(options: Any, setting: RunSetting) -> str | None:
    fraction, where = options.nvme_offload_fraction, options.nvme_offload_dir
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        return f"nvme_offload_fraction must be a number in [0, 1], got {fraction!r}."
    if not 0.0 <= fraction <= 1.0:
        return f"nvme_offload_fraction must be in [0, 1], got {fraction!r}."
    if where is not None and not isinstance(where, str):
        return f"nvme_offload_dir must be a path (a str) or None, got {where!r}."
    if fraction and _is_int8(options.optimizer_states):
        return (
            f"nvme_offload_fraction={fraction:g} with optimizer_states='int8': 8-bit moments "
            "stay in memory (a quarter of fp32's), so the tier would hold nothing; use "
            "optimizer_states 'fp32' or 'bf16' with it, or nvme_offload_fraction=0."
        )
    if fraction and not options.states_on_host():
        return (
            f"nvme_offload_fraction={fraction:g} moves optimizer states the host steps to "
            f"disk, but these options keep them on the device: {options.HOST_STATES_HINT} "
            "with it, or nvme_offload_fraction=0."
        )
    return None


#: The rule of ``nvme_offload_fraction`` / ``nvme_offload_dir`` (a share of
#: the host's optimizer states on disk: pc_offload [Note: the NVMe tier]),
#: shared by the plugins that take them; each says how its states go to
#: the host (``states_on_host()``, ``HOST_STATES_HINT``).
NVME_RULE = Rule(
    "nvme_offload_fraction outside [0, 1], or without states on the host",
    _nvme,
    ({"nvme_offload_fraction": 1.0}, RunSetting()),
)


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes per rank a plugin holds at the step (the ZeRO
    paper's accounting), and how many of them live on the host."""

    parameters: float
    gradients: float
    masters: float
    optimizer: float
    host: float = 0.0
    # Of those on the host, the bytes kept on the disk tier instead (not
    # counted in ``host``).
    disk: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.masters + self.optimizer

    def on_disk(self, fraction: float, host_share: float = 1.0) -> StateBytes:
        """These states with ``fraction`` of the moments held on the host
        (``host_share`` of them) on the disk tier instead (pc_offload [Note:
        the NVMe tier]). The masters stay: the plugins' fp32 pieces are
        the optimizer's parameters, which the tier does not hold."""
        if not fraction or not self.host:
            return self
        disk = min(fraction * host_share * self.optimizer, self.host)
        return replace(self, host=self.host - disk, disk=disk)


def _finite_max_norm(options: Any, setting: RunSetting) -> str | None:
    value = getattr(options, "max_norm", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"max_norm must be a number (0 for no clipping), got {value!r}."
    if not math.isfinite(value) or value < 0:
        return f"max_norm must be finite and >= 0 (0 turns clipping off), got {value!r}."
    return None


RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True, kw_only=True)
class BlockOptions:
    """Options every plugin takes, applied to each transformer block of the
    model before the plugin wraps it ([Note: per-block compile and
    recomputation] in pc_booster.plugins.optimizations):

    - ``compile``: each block through ``torch.compile`` (``compile_backend``,
      default ``"inductor"``), as torchtitan compiles per block;
    - ``activation_checkpointing``: ``"full"`` recomputes a block's forward
      in backward, ``"selective"`` keeps the outputs of its matrix products
      and attention and recomputes the pointwise operations;
      ``activation_checkpointing_fraction``: the share of blocks (the first
      ones) recomputed, as Colossal-AI's ``gradient_checkpointing_ratio``.
    """

    compile: bool = False
    compile_backend: str = "inductor"
    activation_checkpointing: str = "none"
    activation_checkpointing_fraction: float = 1.0

    def changes_blocks(self) -> bool:
        return self.compile or self.activation_checkpointing != "none"


def _block_options(options: Any, setting: RunSetting) -> str | None:
    if not isinstance(options, BlockOptions):
        return None
    compile_on: Any = options.compile  # a user's value, of any type
    if not isinstance(compile_on, bool):
        return f"compile must be True or False, got {compile_on!r}."
    if not isinstance(options.compile_backend, str) or not options.compile_backend:
        return (
            f"compile_backend must name a torch.compile backend, got {options.compile_backend!r}."
        )
    if options.activation_checkpointing not in RECOMPUTE:
        return (
            f"activation_checkpointing must be one of {', '.join(RECOMPUTE)}, got "
            f"{options.activation_checkpointing!r}."
        )
    fraction = options.activation_checkpointing_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        return (
            "activation_checkpointing_fraction is the share of blocks recomputed, in (0, 1]; "
            f"got {fraction!r}."
        )
    return None


def _accumulation_positive(options: Any, setting: RunSetting) -> str | None:
    if setting.accumulation is not None and setting.accumulation < 1:
        return f"accumulation must be at least 1, got {setting.accumulation}."
    return None


class PluginConfig(BlockOptions, ABC):
    """Base of the plugins' frozen options dataclasses; every plugin takes
    the :class:`BlockOptions`."""

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
        Rule(
            "compile / activation_checkpointing options out of range",
            _block_options,
            ({"activation_checkpointing": "some"}, RunSetting()),
        ),
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

    def build(self) -> Plugin:
        """The plugin these options describe (the plugin class that names
        these options as its ``OPTIONS`` registers itself for them)."""
        plugin = _PLUGINS.get(type(self))
        if plugin is None:
            raise LookupError(f"no plugin registered for {type(self).__name__}")
        return plugin(self)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Options class -> the plugin class built from it, filled in by each
# plugin class as it is defined (Plugin.__init_subclass__).
_PLUGINS: dict[type[PluginConfig], Callable[[PluginConfig], Plugin]] = {}


def register_plugin(options: type[PluginConfig], plugin: Callable[[PluginConfig], Plugin]) -> None:
    _PLUGINS[options] = plugin


@dataclass(frozen=True, kw_only=True)
class LossScaleOptions:
    """fp16's dynamic loss scale, for the options of every plugin that
    trains in fp16; the defaults are ``pc_zero.LossScaleConfig``'s (unused
    in fp32 and bf16)."""

    initial_scale: float = LossScaleConfig.initial_scale
    min_scale: float = LossScaleConfig.min_scale
    max_scale: float = LossScaleConfig.max_scale
    growth_factor: float = LossScaleConfig.growth_factor
    backoff_factor: float = LossScaleConfig.backoff_factor
    growth_interval: int = LossScaleConfig.growth_interval
    hysteresis: int = LossScaleConfig.hysteresis

    def loss_scale(self) -> LossScaleConfig:
        """The settings as pc-zero's optimizers take them (ValueError if
        they are inconsistent)."""
        return LossScaleConfig(**{f.name: getattr(self, f.name) for f in fields(LossScaleConfig)})


# [Note: options declared once]
# A plugin's settings are the fields of its frozen options dataclass, and
# nowhere else: the plugin's constructor takes those fields as keywords (or
# the options object itself), its signature for help() and inspect is made
# from them (options_signature), and the plugin reads them from
# ``self.options``. The constructor adds only what is not a setting of the
# run (process groups it is given, ``precision=``).


def options_from_arguments(
    owner: str,
    config: type[PluginConfig],
    positional: Sequence[str],
    args: Sequence[Any],
    given: dict[str, Any],
) -> PluginConfig:
    """The options of a plugin constructor's call: ``args`` (the options
    object, or the values of the ``positional`` fields) and keyword fields
    ``given``. TypeError, as Python's for a bad call, naming what it takes."""
    base: PluginConfig | None = None
    if len(args) == 1 and isinstance(args[0], config):
        base, args = args[0], ()
    if len(args) > len(positional):
        raise TypeError(
            f"{owner}() takes its options ({config.__name__}) or at most {len(positional)} "
            f"positional argument(s) ({', '.join(positional) or 'none'}), got {len(args)}."
        )
    given = dict(given)
    for name, value in zip(positional, args, strict=False):
        if name in given:
            raise TypeError(f"{owner}() got multiple values for argument {name!r}")
        given[name] = value
    known = [f.name for f in sorted(fields(config), key=lambda f: f.kw_only is True)]
    unknown = [name for name in given if name not in known]
    if unknown:
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
            for name in unknown
            for close in [difflib.get_close_matches(name, known, n=1)]
        ]
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(hints)}; its settings are "
            f"the fields of {config.__name__}: {', '.join(known)}."
        )
    if base is not None:
        return replace(base, **given)
    return config(**given)


def options_signature(
    init: Callable[..., Any], config: type[PluginConfig], positional: Sequence[str]
) -> inspect.Signature:
    """The constructor's signature as a call sees it: ``self``, the
    ``positional`` fields, then the other fields keyword-only with their
    defaults and types, then ``init``'s own keyword-only parameters."""
    kind = inspect.Parameter
    own = [
        p
        for p in inspect.signature(init).parameters.values()
        if p.name != "self" and p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD)
    ]
    params = []
    by_name = {f.name: f for f in fields(config)}
    rest = [n for n in by_name if n not in positional]
    # the plugin's own fields, then the shared ones (LossScaleOptions')
    order = [*positional, *sorted(rest, key=lambda n: by_name[n].kw_only is True)]
    for name in order:
        f = by_name[name]
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = kind.empty
        params.append(
            kind(
                name,
                kind.POSITIONAL_OR_KEYWORD if name in positional else kind.KEYWORD_ONLY,
                default=default,
                annotation=f.type,
            )
        )
    first = inspect.Parameter("self", kind.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([first, *params, *own])


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
        "Every plugin but TorchDDPPlugin, DDPPlugin and HybridParallelPlugin with",
        "`tp_size=1, zero_stage=0` steps shards of the parameters, and refuses at `boost` an",
        "optimizer whose class declares `needs_whole_tensors = True` (pc-compat's `Lamb` and",
        "`Lars`, whose trust ratio is a norm of each whole parameter).",
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
