"""Planning and preflight: everything pc-train checks before a process
starts (:func:`prepare`): the model, corpus and tokenizer, the plugin's own
rules and the splits of the batch and the sequence, what the run needs of
this machine (:func:`preflight`: a writable ``--output-dir`` with room for
two checkpoints, a long enough corpus), the checkpoint to resume from, and
the plugin ``--plugin auto`` chooses, with its reasons."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from pc_booster.checkpoint.paths import create_file
from pc_train.checkpoint import (
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    private_dir,
    refuse_linked_run_dirs,
)
from pc_train.commit import STATE
from pc_train.cost import gib_text, model_shape
from pc_train.data import corpus_bytes_available, min_corpus_tokens, tokenizer_source
from pc_train.failures import bytes_text, os_reason
from pc_train.hardware import DeviceInfo, disk_bandwidth
from pc_train.models import MODEL_PRESETS, ModelSpec, resolve_model
from pc_train.options import PLUGIN_NAMES, PluginKind, PluginOptions
from pc_train.planner import Cluster, rank, search
from pc_train.signing import signing_key
from pc_train.train_config import TrainConfig

__all__ = ["checkpoint_bytes", "preflight", "prepare"]


def prepare(
    config: TrainConfig, world: int, *, fork_safe: bool = False
) -> tuple[TrainConfig, ModelSpec, list[str]]:
    """Check everything that can be checked before a process starts, and
    resolve ``--plugin auto``. Raises ValueError with the fix. ``fork_safe``:
    the caller forks its workers afterwards (see
    :func:`pc_train.train._start_method`)."""
    spec = resolve_model(config.model, config.seq_len)
    _check_sequence(config, spec)  # first: every size below grows with it
    _check_inputs(config, spec)
    reasons: list[str] = []
    if config.plugin == "auto":
        _check_auto_flags(config)  # what auto chooses, or takes from a resumed run
        resumed = _saved_layout(config)
        if resumed is not None:
            config, reasons = resumed
        else:
            config, reasons = _choose_plugin(config, spec, world, fork_safe)
    options = config.plugin_options()
    # The plugin's own rules, the same ones its constructor and boost apply.
    options.check(
        world,
        config.precision,
        spec.layers,
        max_norm=config.clip_norm,
        accumulation=config.accumulation,
        heads=spec.heads,
    )
    dp = options.dp_size(world)
    if config.global_batch_size % (dp * config.accumulation):
        raise ValueError(
            f"global batch size {config.global_batch_size} does not split into {dp} "
            f"data-parallel rank(s) x {config.accumulation} accumulation step(s); use a "
            f"multiple of {dp * config.accumulation}."
        )
    _check_splits(config, spec, options, dp)
    preflight(config, spec)
    refuse_linked_run_dirs(config)  # [Note: paths pc touches in pc_booster.checkpoint.paths]
    signing_key()  # a PC_CHECKPOINT_KEY too short to sign with is refused before any rank starts
    if config.resume == "auto":  # restarts of one command line: resume when there is one
        config = replace(config, resume="latest" if has_checkpoint(config.checkpoint_dir) else None)
    if config.resume is not None:
        path = find_checkpoint(config.checkpoint_dir, config.resume)
        load_trainer_state(path, config)  # raises CheckpointError on a bad checkpoint
    return config, spec, reasons


def _check_inputs(config: TrainConfig, spec: ModelSpec) -> None:
    """The corpus and the tokenizer exist, and the model's vocabulary
    holds the text's ids."""
    if config.corpus is not None and not Path(config.corpus).exists():
        raise ValueError(
            f"corpus {config.corpus!r} does not exist; pass a text file, a directory of text "
            "files, or a datasets directory (save_to_disk)."
        )
    if config.tokenizer is not None and not Path(config.tokenizer).is_dir():
        raise ValueError(f"tokenizer {config.tokenizer!r} is not a directory.")
    if config.tokenizer is None and spec.vocab_size < 256:
        raise ValueError(
            f"model {config.model!r} has a vocabulary of {spec.vocab_size}; byte-level text "
            "needs 256. Pass --tokenizer, or a model with a larger vocabulary."
        )


def _saved_layout(config: TrainConfig) -> tuple[TrainConfig, list[str]] | None:
    """``--plugin auto --resume``: the layout the saved run trained with
    (which ``--plugin auto`` chose when it started), so the resumed run
    repeats its curve bitwise; the planner's choice rests on a measured
    peak, which may tip another way on a later start. None when nothing
    is resumed."""
    which = config.resume
    if which == "auto":
        which = "latest" if has_checkpoint(config.checkpoint_dir) else None
    if which is None:
        return None
    path = find_checkpoint(config.checkpoint_dir, which)
    try:  # data only; prepare verifies the whole checkpoint next (load_trainer_state)
        saved = json.loads((path / STATE).read_text())["config"]
        plugin = saved["plugin"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # load_trainer_state names what is wrong with it
    if plugin not in PLUGIN_NAMES or plugin == "auto":
        return None
    kept = {"nvme_offload_dir", "compile"}  # where the tier goes; the user's compile
    layout = {
        f.name: saved[f.name]
        for f in fields(PluginOptions)
        if f.name != "kind" and f.name not in kept and f.name in saved
    }
    config = replace(config, plugin=plugin, **layout)
    reason = (
        f"--resume with --plugin auto: the layout the saved run trained with "
        f"({config.plugin_options().describe()}, from {path}), so the curve repeats."
    )
    return config, [reason]


def _choose_plugin(
    config: TrainConfig, spec: ModelSpec, world: int, fork_safe: bool
) -> tuple[TrainConfig, list[str]]:
    """``--plugin auto``: the planner's first plan [Note: the planner] for
    this model, world, batch and precision on this machine, among those
    that keep what the user chose (the accumulation, the clipping, a
    recomputation), written into ``config``, and the reasons for it."""
    device = DeviceInfo.detect(config.nproc, config.precision, fork_safe=fork_safe)
    if config.nvme_offload_dir is not None:  # plans with the NVMe tier, at its disk's speed
        device = replace(device, disk_bandwidth=disk_bandwidth(config.nvme_offload_dir))
    if config.step_in_backward:  # the plugin's own refusals (fp16)
        PluginOptions(PluginKind.GEMINI, step_in_backward=True).check(
            world, config.precision, max_norm=config.clip_norm, accumulation=config.accumulation
        )
    nodes = world // config.nproc if config.nproc and world % config.nproc == 0 else 1
    cluster = Cluster(nodes, world // nodes, device, device.bandwidth / 4)
    found = search(
        model_shape(spec), cluster, config.global_batch_size, config.seq_len, config.precision,
        max_norm=config.clip_norm,
    )  # fmt: skip
    # The user's accumulation stays (a pipeline's micro-batches replace it),
    # and so does the recomputation the user asked for.
    recompute = config.activation_checkpointing
    plans = rank([
        plan
        for plan in found
        if plan.accumulation == config.accumulation
        and (recompute == "none" or plan.options.activation_checkpointing == recompute)
    ])  # fmt: skip
    if not plans:
        raise ValueError(
            f"no layout of {spec.name} fits {gib_text(0.9 * device.memory_bytes)} per rank on "
            f"{world} rank(s) with {config.global_batch_size} x {config.seq_len} tokens a step "
            f"and --accumulation {config.accumulation}; raise --accumulation, lower "
            "--global-batch-size or --seq-len, or add ranks (pc-estimate --search lists what "
            "each layout needs)."
        )
    best = plans[0]
    options = best.options
    e = best.estimate
    reasons = [
        f"pc-estimate's planner ranked {len(plans)} plan(s) that fit {world} rank(s) "
        f"({nodes} node(s)); first: {options.describe()}, {best.tokens_per_second:,.0f} tokens/s "
        f"predicted, {gib_text(e.device_bytes)} of {gib_text(0.9 * device.memory_bytes)} "
        "per rank.",
    ]
    if len(plans) > 1:
        runner = plans[1]
        reasons.append(
            f"next: {runner.options.describe()} at {runner.tokens_per_second:,.0f} tokens/s, "
            f"{gib_text(runner.estimate.device_bytes)} per rank."
        )
    if config.step_in_backward and not options.step_in_backward:
        reasons.append(
            f"--step-in-backward is not used: {options.describe()} is predicted faster (--plugin "
            "auto steps in backward where that plan ranks first)."
        )
    chosen = {f.name: getattr(options, f.name) for f in fields(PluginOptions) if f.name != "kind"}
    chosen["compile"] = config.compile  # the planner does not choose it
    chosen["nvme_offload_dir"] = config.nvme_offload_dir  # nor where the tier goes
    if recompute != "none":  # the user's share of the blocks
        chosen["activation_checkpointing_fraction"] = config.activation_checkpointing_fraction
    config = replace(config, plugin=options.name, **chosen)
    return config, reasons


# The layout flags ``--plugin auto`` chooses itself (with their pc-train
# flags): given with it, they would be overwritten, so they are refused.
_AUTO_CHOOSES = {
    "tp": "--tp", "pp": "--pp", "zero_stage": "--zero-stage", "microbatches": "--microbatches",
    "sequence_parallel": "--sequence-parallel", "offload_frac": "--offload-frac",
    "cpu_offload": "--cpu-offload", "sp": "--sp", "sp_mode": "--sp-mode", "ep": "--ep",
    "extra_dp": "--extra-dp", "layers_per_stage": "--layers-per-stage", "pp_style": "--pp-style",
    # fp32, or the least narrowing that fits [Note: the planner].
    "optimizer_states": "--optimizer-states",
    # none, or the least share that fits (--nvme-offload-dir says where).
    "nvme_offload_fraction": "--nvme-offload-fraction",
}  # fmt: skip


def _check_auto_flags(config: TrainConfig) -> None:
    """``--plugin auto`` with a layout flag it would overwrite: refused,
    naming the flags. (``--step-in-backward`` allows stepping in backward,
    ``--activation-checkpointing`` fixes the recomputation, ``--compile``
    is kept.)"""
    default = PluginOptions(PluginKind.DDP)
    given = [
        f"{flag} {getattr(config, name)}"
        for name, flag in _AUTO_CHOOSES.items()
        if getattr(config, name) != getattr(default, name)
    ]
    if given:
        raise ValueError(
            f"--plugin auto chooses the layout itself, and {', '.join(given)} would be "
            "overwritten; drop them, or name the plugin (--plugin hybrid, fsdp, ...) with them "
            "(pc-estimate --search lists the layouts that fit)."
        )


def _check_splits(config: TrainConfig, spec: ModelSpec, options: Any, dp: int) -> None:
    """The divisibility rules of the plan that the plugin's own rules
    cannot see (they know nothing of the batch and the sequence)."""
    per_rank = config.global_batch_size // dp
    if options.pp > 1:
        micro = options.microbatches or options.pp
        if per_rank % micro:
            raise ValueError(
                f"--microbatches {micro} does not divide the {per_rank} sequence(s) each "
                f"pipeline takes per step (--global-batch-size {config.global_batch_size} over "
                f"{dp} data-parallel rank(s)); use a divisor of {per_rank}."
            )
    if options.sp > 1:
        blocks = 2 * options.sp if options.sp_mode == "ring_attn" else options.sp
        if config.seq_len % blocks:
            raise ValueError(
                f"--seq-len {config.seq_len} does not split into {blocks} equal blocks (--sp "
                f"{options.sp}, --sp-mode {options.sp_mode}); use a multiple of {blocks}."
            )
    if options.sequence_parallel and options.tp > 1 and config.seq_len % options.tp:
        raise ValueError(
            f"--seq-len {config.seq_len} does not split over --tp {options.tp} ranks "
            f"(--sequence-parallel); use a multiple of {options.tp}."
        )


# The longest --seq-len a preset takes: its positions follow --seq-len, so
# nothing else bounds it (a config's max_position_embeddings bounds its own).
PRESET_LONGEST = 2**20


def _check_sequence(config: TrainConfig, spec: ModelSpec) -> None:
    """--seq-len within what the model accepts, checked before anything
    whose size grows with it (the plan, the checkpoints' room on disk)."""
    if config.model in MODEL_PRESETS and config.seq_len > PRESET_LONGEST:
        raise ValueError(
            f"--seq-len {config.seq_len:,} is longer than a preset model takes "
            f"({PRESET_LONGEST:,} tokens: its position table grows with --seq-len); use a "
            "shorter --seq-len, or --model a config whose max_position_embeddings allows it."
        )
    positions = _max_positions(spec)
    if positions is not None and config.seq_len > positions:
        raise ValueError(
            f"--seq-len {config.seq_len} is longer than model {spec.name!r} accepts "
            f"({positions} positions); use --seq-len {positions} or less."
        )


def _max_positions(spec: ModelSpec) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(spec.config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def checkpoint_bytes(params: int) -> int:
    """What one checkpoint of a model of ``params`` parameters takes on
    disk, all ranks' shares together, with a margin: 16 bytes per
    parameter (fp32 values and masters, Adam's two moments)."""
    return 16 * params


def _unfinished_bytes(root: Path) -> int:
    """The bytes of the unfinished saves under ``root`` (links not followed),
    which :func:`~pc_train.commit.remove_unfinished` frees before any rank starts."""
    partials = [p for p in root.glob("step-*.partial") if p.is_dir() and not p.is_symlink()]
    return sum(f.stat().st_size for p in partials for f in p.rglob("*") if f.is_file())


def preflight(config: TrainConfig, spec: ModelSpec) -> None:
    """What the run needs of this machine, checked before any rank starts:
    a writable ``--output-dir`` with room for two checkpoints (the newest
    is written before the one before it goes), and a corpus long enough
    for a batch and the held-out split. Raises ValueError with the fix."""
    out = Path(config.output_dir)
    probe = out / f".pc-train-probe-{os.getpid()}"
    try:
        private_dir(out)
        create_file(probe)  # a link planted at that name is removed, not written through
        probe.write_bytes(b"pc-train")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"--output-dir {out} must be writable, but writing {probe.name} there failed: "
            f"{os_reason(error)}; pass a writable --output-dir."
        ) from None
    need = 2 * checkpoint_bytes(model_shape(spec).params)
    # What a save that failed (a full disk) left is removed before any rank
    # starts (remove_unfinished) [Note: disk errors named].
    free = shutil.disk_usage(out).free + _unfinished_bytes(config.checkpoint_dir)
    if free < need:
        raise ValueError(
            f"--output-dir {out} has {bytes_text(free)} ({free:,} bytes) free; two checkpoints of "
            f"{spec.name} need {bytes_text(need)} ({need:,} bytes: 16 per parameter each); free "
            "space there or pass --output-dir on a larger disk."
        )
    tokenized = tokenizer_source(config.tokenizer, spec.pretrained) is not None
    available = None if tokenized else corpus_bytes_available(config.corpus, config.corpus_bytes)
    least = min_corpus_tokens(config.seq_len)
    if available is not None and available < least:  # bytes are tokens without a tokenizer
        raise ValueError(
            f"the corpus holds {available:,} byte(s); --seq-len {config.seq_len} needs at least "
            f"{least:,} (95% trains, 5% is held out, each longer than a sequence); pass a "
            "larger --corpus / --corpus-bytes or a shorter --seq-len."
        )
