"""``pc-train``'s configuration: one frozen dataclass, read from defaults,
then a YAML file (``--config``), then the command line, each overriding
the one before."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pc_train.models import MODEL_PRESETS
from pc_train.options import (
    LAYOUT_HELP,
    PLUGIN_NAMES,
    PRECISIONS,
    LayoutOptions,
    PluginOptions,
    add_layout_flags,
    layout_field_type,
)

__all__ = ["TrainConfig", "parse_args"]


# (field, lower bound test, upper bound, what it must be): the float settings.
_RANGES: tuple[tuple[str, Any, float, str], ...] = (
    ("lr", lambda v: v > 0, math.inf, "positive and finite"),
    ("weight_decay", lambda v: v >= 0, math.inf, "finite and >= 0"),
    ("clip_norm", lambda v: v >= 0, math.inf, "a finite global norm >= 0 (0: no clipping)"),
    ("timeout", lambda v: v > 0, 1e7, "a number of seconds > 0 and at most 1e7 (116 days)"),
    ("offload_frac", lambda v: v >= 0, 1.0, "a share in [0, 1]"),
    ("nvme_offload_fraction", lambda v: v >= 0, 1.0, "a share in [0, 1]"),
    ("activation_checkpointing_fraction", lambda v: v > 0, 1.0, "a share of blocks in (0, 1]"),
)


@dataclass(frozen=True)
class TrainConfig(LayoutOptions):
    """Everything a run depends on; the same on every rank. ``help`` of
    each field is in ``pc-train --help``. The layout fields are
    :class:`~pc_train.options.LayoutOptions`' (keyword-only), shared with
    the plugin options and pc-estimate."""

    model: str = "gpt2-tiny"
    steps: int = 200
    global_batch_size: int = 16
    accumulation: int = 1
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0
    plugin: str = "auto"
    precision: str = "fp32"
    corpus: str | None = None
    corpus_bytes: int = 2_000_000
    tokenizer: str | None = None
    output_dir: str = "runs/pc-train"
    checkpoint_every: int = 50
    keep_last: int = 2
    async_save: bool = False
    resume: str | None = None
    extend_schedule: bool = False
    eval_every: int = 50
    log_every: int = 10
    deterministic: bool = True
    check_finite: bool = True
    timeout: float = 600.0
    debug_collectives: bool = False
    tensorboard: bool = True
    progress: bool = True
    nproc: int = 2

    def __post_init__(self) -> None:
        for item in fields(self):
            value, kind = getattr(self, item.name), _field_type(item.name)
            optional = item.default is None
            if value is None and optional:
                continue
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            ok = (
                (kind is bool and isinstance(value, bool))
                or (kind is int and is_number and float(value).is_integer())
                or (kind is float and is_number)
                or (kind is str and isinstance(value, str))
            )
            if not ok:
                raise TypeError(
                    f"{item.name} must be {'None or ' if optional else ''}{kind.__name__}, got "
                    f"{value!r} ({type(value).__name__})."
                )
        positive = (
            "steps",
            "global_batch_size",
            "accumulation",
            "seq_len",
            "corpus_bytes",
            "log_every",
            "keep_last",
            "nproc",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")
        for name in ("warmup", "checkpoint_every", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: never), got {value!r}.")
        # Every number in one place: finite, and in its range (nan compares
        # false with everything, so each test is written to fail on it).
        for name, low, high, what in _RANGES:
            value = float(getattr(self, name))
            if not (math.isfinite(value) and low(value) and value <= high):
                raise ValueError(f"{name} must be {what}, got {value!r}.")
        if self.plugin not in PLUGIN_NAMES:
            raise ValueError(
                f"unknown plugin {self.plugin!r}; expected one of {', '.join(PLUGIN_NAMES)}."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}.")

    def plugin_options(self) -> PluginOptions:
        """The plugin and the layout fields of this config."""
        layout = {f.name: getattr(self, f.name) for f in fields(LayoutOptions)}
        return PluginOptions.parse(self.plugin, **layout)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_HELP = {
    "model": f"a preset ({', '.join(MODEL_PRESETS)}), a config .json, or a save_pretrained "
    "directory (its weights are loaded)",
    "steps": "optimizer steps in the whole run (a resumed run counts from its checkpoint)",
    "global_batch_size": "sequences per step over all data-parallel ranks",
    "accumulation": "micro-steps per step (gradient accumulation) on each rank",
    "seq_len": "tokens per sequence",
    "warmup": "linear warm-up steps before the cosine decay",
    "clip_norm": "clip gradients to this global norm (0: off)",
    "plugin": "auto asks pc-estimate; hybrid takes --tp/--pp/--zero-stage",
    "corpus": "a text file, a directory of text files, or a datasets directory "
    "(default: the Python standard library's sources)",
    "corpus_bytes": "read at most this many bytes of the corpus",
    "tokenizer": "a tokenizer directory (default: bytes, vocabulary 256)",
    "output_dir": "checkpoints, TensorBoard logs and the report go here",
    "checkpoint_every": "save every N steps (0: only at the end)",
    "keep_last": "checkpoints to keep",
    "async_save": "write checkpoints in the background: each rank copies its share to host "
    "memory and training goes on (the report gives the stall per save)",
    "resume": "'latest' (a bare --resume), a checkpoint directory, or 'auto' (resume when a "
    "checkpoint exists, else start: for restarts of one command line)",
    "extend_schedule": "with --resume and --steps past the saved run's schedule: stretch "
    "the cosine decay to the new --steps (the warm-up as it was) instead of refusing",
    "eval_every": "held-out loss every N steps (0: only at the start and end)",
    "log_every": "progress and TensorBoard every N steps",
    "deterministic": "deterministic kernels, so a resumed run repeats the loss curve bitwise",
    "check_finite": "stop, naming the step and the ranks, when the loss turns inf or NaN",
    "timeout": "seconds a collective may wait for the other ranks before the run fails",
    "debug_collectives": "check that every rank calls the same collective with the same "
    "shapes (slow: for debugging)",
    "nproc": "local processes to start (ignored under torchrun)",
}


def _field_type(name: str) -> Any:
    if name in LAYOUT_HELP:
        return layout_field_type(name)
    default = TrainConfig.__dataclass_fields__[name].default
    if isinstance(default, bool):
        return bool
    if isinstance(default, int | float):
        return type(default)
    if name == "microbatches":
        return int
    return str


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pc-train",
        description="Train a transformers causal LM on local processes (or under torchrun) "
        "with any pc plugin. Settings: defaults < --config YAML < command line.",
        epilog="Exit codes: 0 finished; 1 a failure (a crash, a rank that died or stalled: "
        "running again with --resume may succeed); 2 an error to fix first (bad settings or "
        "input, a full disk, a read-only directory, a bad checkpoint, a run that diverged); "
        "130 interrupted after saving a checkpoint.",
    )
    parser.add_argument("--config", help="a YAML file of settings (keys as below, - or _)")
    for item in fields(TrainConfig):
        if item.name in LAYOUT_HELP:
            continue  # below, from the layout's own fields
        flag = "--" + item.name.replace("_", "-")
        kind = _field_type(item.name)
        default = item.default if item.default is not MISSING else None
        text = f"{_HELP.get(item.name, '')} (default: {default})".strip()
        if item.name == "resume":
            parser.add_argument(
                flag, nargs="?", const="latest", default=argparse.SUPPRESS, help=text
            )
        elif kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        elif item.name == "plugin":
            parser.add_argument(flag, choices=PLUGIN_NAMES, default=argparse.SUPPRESS, help=text)
        elif item.name == "precision":
            parser.add_argument(flag, choices=PRECISIONS, default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    add_layout_flags(parser, suppress_defaults=True)
    return parser


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise ValueError(
            "--config needs PyYAML, a dependency of pc-train: pip install pyyaml."
        ) from None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path} must hold a mapping of settings, got {type(data).__name__}."
        )
    known = {f.name for f in fields(TrainConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(
                f"--config {path}: unknown setting {key!r}; known settings: "
                f"{', '.join(sorted(known))}."
            )
        out[name] = value  # types are checked once, by TrainConfig
    return out


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The run's configuration; exits with a usage message on bad input."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    try:
        settings = _read_yaml(args.pop("config")) if args.get("config") else {}
        args.pop("config", None)
        settings.update(args)
        if "RANK" in os.environ:  # under torchrun: the world is torchrun's
            settings["nproc"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return TrainConfig(**settings)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
