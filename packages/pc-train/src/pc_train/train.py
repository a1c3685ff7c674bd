"""``pc-train``: train a ``transformers`` causal LM with any pc plugin.

Run it plainly and it starts ``--nproc`` local processes itself through
torch's elastic launcher; run it under ``torchrun`` and it joins the job
torchrun started (any number of nodes). Every step's global batch is a
function of (seed, step), split over the data-parallel ranks, so a resumed
run sees the batches an uninterrupted one would; checkpoints hold the
model, optimizer, LR schedule, every rank's RNG and the history, so with
``--deterministic`` (the default) a resumed run repeats the loss curve
bitwise. See docs/packages/pc-train.md for the tour.
"""

from __future__ import annotations

import copy
import errno
import logging
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import health, tune_host_allocator
from pc_train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    model_and_optimizer,
    save_checkpoint,
)
from pc_train.data import (
    batch_offsets,
    corpus_bytes_available,
    load_byte_corpus,
    load_corpus,
    min_corpus_tokens,
    windows,
)
from pc_train.faults import FaultInjector, join_memory_cgroup
from pc_train.memory import PhaseMemory
from pc_train.models import (
    MODEL_PRESETS,
    ModelSpec,
    build_model,
    reads_pretrained_after_boost,
    resolve_model,
)
from pc_train.train_config import TrainConfig, parse_args

__all__ = [
    "MODEL_PRESETS",
    "NonFiniteLossError",
    "TrainConfig",
    "Trainer",
    "load_byte_corpus",
    "main",
    "prepare",
    "train",
]

_ERROR_DIR = "PC_TRAIN_ERROR_DIR"


class NonFiniteLossError(ValueError):
    """The loss became inf or NaN (``--check-finite``)."""


class _Phases:
    """What this rank is doing ("backward of step 12"), declared on pc-comm's
    health board, where the other ranks read it when an operation fails."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.current = "start-up"

    def enter(self, phase: str, step: int | None = None) -> None:
        """``phase`` of ``step``, or ``phase`` alone (start-up, the report)."""
        current = phase if step is None else f"{phase} of step {step}"
        if current != self.current:  # accumulation re-enters backward
            self.current = current
            health.set_phase(current)


# How long a rank stopped by the launcher after a peer died waits for its own
# error about that peer (shared memory notices in 50 ms, gloo at once).
_PEER_ERROR_S = 2.0


class _Stop:
    """SIGINT / SIGTERM ask for a stop; the ranks agree on the step, save a
    checkpoint there and exit. The same tiny all-reduce, once per step
    before the optimizer steps, carries each rank's finite-loss check."""

    def __init__(self, phases: _Phases, grace: float) -> None:
        self.asked = False
        self.phases = phases
        self.grace = grace  # after SIGTERM, seconds to reach the step's end and save
        self.timer: threading.Thread | None = None
        self.agreed = False  # every rank agreed to stop: they save together and exit
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = True
        if signum == signal.SIGTERM and self.timer is None:
            # A scheduler's preemption or the launcher stopping the job after
            # another rank failed. A rank blocked on a dead peer never reaches
            # the step's end: leave after the grace period, saying where it was.
            # When a peer is gone (the failure that made the launcher stop
            # the job) before the ranks agreed to stop, no step can finish:
            # leave at once.
            self.timer = threading.Thread(target=self._leave_when_stuck, daemon=True)
            self.timer.start()

    def _leave_when_stuck(self) -> None:
        deadline = time.monotonic() + self.grace
        gone: list[int] = []
        while time.monotonic() < deadline and (self.agreed or not gone):
            time.sleep(0.1)
            gone = [] if self.agreed else health.gone_ranks()
        if gone:
            # This rank's own error, waiting on the gone peer, names it and
            # where every rank was: give it a moment to come first.
            time.sleep(min(_PEER_ERROR_S, max(0.0, deadline - time.monotonic())))
        where = self.phases.current
        after = f" (rank(s) {', '.join(map(str, gone))} gone)" if gone else ""
        _leave(f"rank {self.phases.rank} was in {where} when the launcher stopped it{after}.", 143)

    def agree(self, finite: bool) -> tuple[bool, list[int]]:
        """(stop asked on any rank, ranks whose loss is not finite)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(world + 1)
        flags[0] = 1.0 if self.asked else 0.0
        flags[1 + rank] = 0.0 if finite else 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.agreed = bool(flags[0])
        return self.agreed, [r for r in range(world) if flags[1 + r] > 0]


def prepare(
    config: TrainConfig, world: int, *, fork_safe: bool = False
) -> tuple[TrainConfig, ModelSpec, list[str]]:
    """Check everything that can be checked before a process starts, and
    resolve ``--plugin auto``. Raises ValueError with the fix. ``fork_safe``:
    the caller forks its workers afterwards (see :func:`_start_method`)."""
    from pc_train.estimate import DeviceInfo, model_shape, recommend
    from pc_train.options import PluginKind, PluginOptions

    spec = resolve_model(config.model, config.seq_len)
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
    layers = spec.layers
    reasons: list[str] = []
    if config.plugin == "auto":
        dp_batch = config.global_batch_size // max(1, world)
        micro = max(1, dp_batch // config.accumulation)
        device = DeviceInfo.detect(config.nproc, config.precision, fork_safe=fork_safe)
        if config.step_in_backward:  # the plugin's own refusals (fp16)
            PluginOptions(PluginKind.GEMINI, step_in_backward=True).check(
                world, config.precision, max_norm=config.clip_norm, accumulation=config.accumulation
            )
        # Stepping in backward is chosen only where it changes nothing the
        # user asked for: no clipping, no accumulation (recommend excludes fp16).
        in_bwd = config.step_in_backward or (config.clip_norm == 0 and config.accumulation == 1)
        choice = recommend(
            model_shape(spec),
            world,
            micro,
            config.seq_len,
            config.precision,
            device,
            step_in_backward=in_bwd,
        )
        opts = choice.options
        reasons = list(choice.reasons)
        if config.step_in_backward and not opts.step_in_backward:
            reasons.append(
                f"--step-in-backward is not used: {opts.describe()} is recommended (--plugin "
                "auto steps in backward only where plain gemini does not fit, and not in fp16)."
            )
        config = replace(
            config,
            plugin=opts.name,
            offload_frac=opts.offload_frac,
            step_in_backward=opts.step_in_backward,
        )
    options = config.plugin_options()
    # The plugin's own rules, the same ones its constructor and boost apply.
    options.check(
        world,
        config.precision,
        layers,
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
    if config.resume == "auto":  # restarts of one command line: resume when there is one
        config = replace(config, resume="latest" if has_checkpoint(config.checkpoint_dir) else None)
    if config.resume is not None:
        path = find_checkpoint(config.checkpoint_dir, config.resume)
        load_trainer_state(path, config)  # raises CheckpointError on a bad checkpoint
    return config, spec, reasons


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


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def _os_reason(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno == errno.EROFS:
        return "read-only file system"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return error.strerror or type(error).__name__


def preflight(config: TrainConfig, spec: ModelSpec) -> None:
    """What the run needs of this machine, checked before any rank starts:
    a writable ``--output-dir`` with room for two checkpoints (the newest
    is written before the one before it goes), and a corpus long enough
    for a batch and the held-out split. Raises ValueError with the fix."""
    from pc_train.estimate import model_shape

    out = Path(config.output_dir)
    probe = out / f".pc-train-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"pc-train")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"--output-dir {out} must be writable, but writing {probe.name} there failed: "
            f"{_os_reason(error)}; pass a writable --output-dir."
        ) from None
    need = 2 * checkpoint_bytes(model_shape(spec).params)
    free = shutil.disk_usage(out).free
    if free < need:
        raise ValueError(
            f"--output-dir {out} has {_bytes(free)} ({free:,} bytes) free; two checkpoints of "
            f"{spec.name} need {_bytes(need)} ({need:,} bytes: 16 per parameter each); free "
            "space there or pass --output-dir on a larger disk."
        )
    tokenized = _tokenizer_source(config, spec) is not None
    available = None if tokenized else corpus_bytes_available(config.corpus, config.corpus_bytes)
    least = min_corpus_tokens(config.seq_len)
    if available is not None and available < least:  # bytes are tokens without a tokenizer
        raise ValueError(
            f"the corpus holds {available:,} byte(s); --seq-len {config.seq_len} needs at least "
            f"{least:,} (95% trains, 5% is held out, each longer than a sequence); pass a "
            "larger --corpus / --corpus-bytes or a shorter --seq-len."
        )


# -- the training loop ----------------------------------------------------------


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "CUDA allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "host RSS"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _schedule(total: int, warmup: int) -> Any:
    """The learning rate's factor after ``step`` steps: a linear warm-up
    over ``warmup`` steps, then a cosine from 1 to 0 at step ``total`` (the
    schedule's length: the --steps of the run that started it), 0 after."""

    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    return factor


def _schedule_steps(config: TrainConfig, state: dict[str, Any] | None) -> int:
    """The schedule's length: the saved one on resume (a checkpoint written
    before it was recorded: the --steps it was saved under), else --steps."""
    if state is None:
        return config.steps
    saved = state.get("schedule_steps", state.get("config", {}).get("steps", config.steps))
    return int(saved)


def _cpu_threads(local_ranks: int) -> int:
    """Threads per rank: the cores this process may run on, shared."""
    from pc_comm import usable_cores

    return max(1, usable_cores() // max(1, local_ranks))


def _peak_flops(device: torch.device, local_ranks: int, precision: str) -> tuple[float, str]:
    """The MFU's denominator per rank: the GPU's datasheet, or a CPU
    matmul measured on the threads this rank trains with (the FLOP count
    is per rank, so the peak must be too)."""
    from pc_train.estimate import DeviceInfo, cpu_peak_flops

    if device.type == "cuda":
        return DeviceInfo.detect(local_ranks, precision).peak_flops, "datasheet"
    threads = torch.get_num_threads()
    return cpu_peak_flops(threads), f"measured matmul, {threads} thread(s) per rank"


def _tokenizer_source(config: TrainConfig, spec: ModelSpec) -> str | None:
    source = config.tokenizer
    files = ("tokenizer.json", "tokenizer_config.json")
    if source is None and spec.pretrained is not None:
        pretrained = spec.pretrained
        source = str(pretrained) if any((pretrained / f).exists() for f in files) else None
    return source


def _tokenizer(config: TrainConfig, spec: ModelSpec) -> Any:
    source = _tokenizer_source(config, spec)
    if source is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


class _Progress:
    """Rank 0's progress: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, config: TrainConfig, start: int, enabled: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled
        if enabled and config.progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

                self.bar = tqdm(total=config.steps, initial=start, desc="pc-train", unit="step")
            except ImportError:
                pass

    def update(self, step: int, total: int, fields: dict[str, str], log: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if log:
                self.bar.set_postfix(fields, refresh=True)
        elif log:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            print(f"step {step:>6}/{total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _writer(config: TrainConfig, enabled: bool) -> Any:
    if not (enabled and config.tensorboard):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("pc-train: TensorBoard logs skipped: pip install tensorboard", flush=True)
        return None
    return SummaryWriter(str(Path(config.output_dir) / "tensorboard"))


class Trainer:
    """One rank's training run (collective: every rank builds one and calls
    :meth:`run`). Building it does what every rank needs before the first
    step, in the order the run depends on: the plugin and Booster, the
    corpus, the boosted model, optimizer and LR schedule, the resumed state
    (model, optimizer, schedule, RNG, history), then the held-out batch and
    the estimate the throughput is measured against. :meth:`run` prints the
    header and trains from there to ``config.steps``: one
    :meth:`train_step` at a time, each followed by :meth:`log`, an
    :meth:`evaluate` every ``eval_every`` steps and a :meth:`save` every
    ``checkpoint_every``; rank 0 ends with :meth:`report`."""

    def __init__(
        self,
        config: TrainConfig,
        context: Any,
        reasons: Sequence[str] = (),
        phases: _Phases | None = None,
    ) -> None:
        from pc_booster import Booster
        from pc_train.estimate import estimate, model_shape

        self.config = config
        # pc_comm.init_distributed's result: this rank's environment, device, backend.
        self.context = context
        self.env = context.env
        self.device: torch.device = context.device
        # Rank 0 prints, writes TensorBoard logs and the report.
        self.rank0 = self.env.rank == 0
        # Where this rank is, on pc-comm's health board, for failure reports.
        self.phases = phases or _Phases()
        self.phases.enter("start-up")
        # With --resume: the checkpoint and its trainer state, checked.
        self.checkpoint: Path | None = None
        self.saved: dict[str, Any] | None = None
        if config.resume is not None:
            self.checkpoint = find_checkpoint(config.checkpoint_dir, config.resume)
            self.saved = load_trainer_state(self.checkpoint, config)
        # The LR schedule's length, fixed by the run that started it.
        self.schedule_steps = _schedule_steps(config, self.saved)
        # Why --plugin auto chose the plugin; printed under the header.
        self.reasons = tuple(reasons)
        self.spec = resolve_model(config.model, config.seq_len)
        self.options = config.plugin_options()
        self.plugin = self.options.make(config.clip_norm, config.timeout)
        self.booster = Booster(
            plugin=self.plugin,
            mixed_precision=None if config.precision == "fp32" else config.precision,
        )
        # A pipeline step runs forward and backward together, through the booster.
        self.pipeline = self.options.pp > 1  # only hybrid takes --pp
        # The corpus' size goes in the header; 95% trains, the rest is held out.
        self.corpus_tokens, self.train_tokens, self.eval_tokens = self._load_tokens()
        # Each rank's peak memory per phase (build, load, train, save), for the report.
        self.memory = PhaseMemory(self.device)
        with self.memory.phase("build"):
            self.model, self.optimizer, self.schedule = self._boost()
        # The checkpoint being written in the background (--async-save).
        self.pending_save: Future[Path] | None = None
        self.copy_waits = 0.0  # the Booster's async_save_waits at the last save
        # The batch is split over the data-parallel ranks (a pipeline's or a
        # tensor-parallel group's ranks see the same sequences).
        self.group = self.plugin.dp_group
        self.dp_rank, self.dp = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.per_rank = config.global_batch_size // self.dp
        self.micro = self.per_rank // config.accumulation
        # Losses every step, logged throughput and memory, held-out losses;
        # saved in each checkpoint, so a resumed run's report covers the whole run.
        self.history: dict[str, Any] = {
            "step": [],
            "loss": [],
            "log": [],
            "eval_step": [],
            "eval_loss": [],
        }
        # The step this run started from, and every step a run resumed at.
        self.start = 0
        self.resumed_at: list[int] = []
        # Here, in the order the run had before the Trainer: what follows
        # touches torch's RNG after it is restored (model_shape builds the
        # model from the seed; rank 0 measures the CPU's peak on random
        # matrices).
        self.resume()
        # Steps taken so far (the next one is step + 1, as logged).
        self.step = self.start
        self.eval_ids = self._eval_batch()
        self.shape = model_shape(self.spec)
        self.predicted = estimate(
            self.shape, self.options, self.env.world_size, self.micro, config.seq_len,
            config.precision,
        )  # fmt: skip
        self.flops_per_token = self.predicted.flops_per_step / self.predicted.tokens_per_step
        # The MFU's denominator: the GPU's datasheet, or a CPU matmul
        # measured on this rank's threads.
        self.peak, self.peak_source = (
            _peak_flops(self.device, self.env.local_world_size, config.precision)
            if self.rank0
            else (1.0, "")
        )
        # PC_TRAIN_FAULT: kill or stall this rank at one (step, phase), for fault tests.
        self.fault = FaultInjector()
        # Model states at their peak, measured in the first step this run
        # takes after one has built the optimizer's states; for the report.
        self.model_states: dict[str, float] = {}
        # Tokens trained since the last log line, and when that line was.
        self.window_start, self.window_tokens = 0.0, 0
        # Set by run(): a stop asked by SIGINT / SIGTERM, rank 0's progress
        # bar or lines, and its TensorBoard writer.
        self.stop: _Stop | None = None
        self.progress: _Progress | None = None
        self.writer: Any = None

    # -- building -------------------------------------------------------------

    def _load_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        config, spec = self.config, self.spec
        tokens = load_corpus(config.corpus, config.corpus_bytes, _tokenizer(config, spec))
        least = min_corpus_tokens(config.seq_len)
        if len(tokens) < least:
            raise ValueError(
                f"the corpus holds {len(tokens):,} token(s); --seq-len {config.seq_len} needs at "
                f"least {least:,} (95% trains, 5% is held out, each longer than a sequence); "
                "pass a larger --corpus / --corpus-bytes or a shorter --seq-len."
            )
        if int(tokens.max()) >= spec.vocab_size:
            raise ValueError(
                f"the tokenizer makes ids up to {int(tokens.max())}, beyond the model's "
                f"vocabulary ({spec.vocab_size}); use a model with a matching vocabulary."
            )
        split = int(len(tokens) * 0.95)
        return tokens, tokens[:split], tokens[split:]

    def _boost(self) -> tuple[Any, Any, Any]:
        """The model, AdamW and the warm-up + cosine LR schedule, boosted."""
        config = self.config
        # Built lazily: boost materialises each rank's share only, with the
        # values eager construction gives; pretrained safetensors are then
        # read by slices, each rank its share.
        model = build_model(self.spec, config.seed, self.device, lazy=True)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _schedule(self.schedule_steps, config.warmup)
        )
        model, optimizer, _, _, schedule = self.booster.boost(
            model, optimizer, lr_scheduler=schedule
        )
        if self.spec.pretrained is not None and reads_pretrained_after_boost(self.spec):
            self.booster.load_model(model, self.spec.pretrained)
        return model, optimizer, schedule

    def resume(self) -> None:
        """With ``--resume``: the model, optimizer, LR schedule, this rank's
        RNG (at the same world size) and the history from the checkpoint."""
        config, env = self.config, self.env
        if self.checkpoint is None or self.saved is None:
            return
        path, state = self.checkpoint, self.saved
        self.phases.enter(f"loading {path}")
        self.memory.enter("load")
        try:
            model_path, optimizer_path = model_and_optimizer(path)
            self.booster.load_model(self.model, model_path)
            self.booster.load_optimizer(self.optimizer, optimizer_path)
            self.booster.load_lr_scheduler(self.schedule, path / "scheduler.pt")
        except Exception as error:  # a checkpoint that passed the checks but will not load
            raise CheckpointError(f"checkpoint {path} does not load: {error}") from None
        rng = path / f"rng-rank{env.rank}.pt"
        if state["world"] == env.world_size and rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        elif self.rank0:
            print(
                f"pc-train: saved at world {state['world']}, resumed at {env.world_size}: RNG "
                "states start fresh (the loss curve may differ in the last bits)",
                flush=True,
            )
        self.start = state["step"]
        self.history = state["history"]
        self.resumed_at = [*state.get("resumed_at", []), self.start]
        if self.rank0 and self.schedule_steps != config.steps:
            print(
                f"pc-train: --steps {config.steps}, the learning-rate schedule stays the saved "
                f"run's: warm-up, then cosine to 0 at step {self.schedule_steps}"
                + (", 0 after it" if config.steps > self.schedule_steps else "")
                + f" (a schedule is fixed when its run starts; for a new one, pc-export {path} "
                "<dir>, then start a run with --model <dir>)",
                flush=True,
            )

    def _eval_batch(self) -> torch.Tensor:
        """This rank's share of 32 held-out sequences, the same every evaluation."""
        config, share = self.config, 32 // self.dp
        eval_ids = windows(
            self.eval_tokens,
            torch.linspace(0, len(self.eval_tokens) - config.seq_len - 1, 32).long(),
            config.seq_len,
        )
        return eval_ids[self.dp_rank * share : (self.dp_rank + 1) * share].to(self.device)

    # -- the run --------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to ``config.steps`` (collective). Returns the history; raises
        SystemExit(130) after saving where SIGINT / SIGTERM stopped it."""
        config = self.config
        self.announce()
        if self.start == 0:
            self.phases.enter("eval", 0)
            self.evaluate(0)
        # After SIGTERM, a rank blocked on a failed peer gets its own timeout,
        # plus a margin, to say where it is before it leaves.
        self.stop = _Stop(self.phases, grace=min(config.timeout + 2.0, 60.0))
        self.progress = _Progress(config, self.start, self.rank0)
        self.writer = _writer(config, self.rank0)
        began = time.perf_counter()
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.memory.enter("train")
        interrupted = False
        while self.step < config.steps:
            interrupted = self.train_step()
            self.log()
            every = config.eval_every
            if every and self.step % every == 0 and self.step < config.steps:
                self.periodic_evaluate()
            if _periodic(config, self.step) or interrupted or self.step == config.steps:
                self.save()
            if interrupted:
                break
        self.progress.close()
        self.finish_save()
        self.memory.close()
        phases = [None] * self.env.world_size
        dist.all_gather_object(phases, self.memory.peaks)
        self.memory_by_phase = phases
        if interrupted:
            if self.rank0:
                print(
                    f"pc-train: interrupted at step {self.step}; saved "
                    f"{config.checkpoint_dir / f'step-{self.step:06d}'}. Continue with --resume.",
                    flush=True,
                )
            raise SystemExit(130)
        self.evaluate(self.step)
        if self.writer is not None:
            self.writer.close()
        seconds = time.perf_counter() - began
        if self.rank0:
            self.phases.enter("writing the report")
            self.report(seconds)
        return self.history

    def announce(self) -> None:
        """Rank 0's header: model, plugin, ranks, batch, corpus; the reasons
        of --plugin auto."""
        if not self.rank0:
            return
        config = self.config
        print(
            f"pc-train: {self.spec.name} ({self.shape.params / 1e6:.2f} M params) with "
            f"{self.options.describe()} on {self.env.world_size} {self.context.backend} "
            f"rank(s), global batch {config.global_batch_size} x {config.seq_len} tokens, "
            f"{len(self.corpus_tokens) / 1e6:.2f} M-token corpus",
            flush=True,
        )
        for reason in self.reasons:
            print(f"  plugin auto: {reason}", flush=True)

    def batch(self) -> torch.Tensor:
        """This rank's sequences of the next step's global batch, a function
        of (seed, step) alone, so a resumed run sees what an uninterrupted
        one would."""
        config = self.config
        offsets = batch_offsets(
            config.seed, self.step, config.global_batch_size, config.seq_len,
            len(self.train_tokens),
        )  # fmt: skip
        mine = offsets[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
        return windows(self.train_tokens, mine, config.seq_len).to(self.device)

    def train_step(self) -> bool:
        """Take one optimizer step: forward and backward over the batch, the
        ranks' agreement on a stop and on a finite loss, the step, the
        loss averaged over the data-parallel ranks into the history.
        Returns whether a stop was asked (SIGINT / SIGTERM on any rank)."""
        if self.stop is None:
            raise AssertionError("Trainer.train_step runs inside Trainer.run")
        config, step = self.config, self.step + 1
        mine = self.batch()
        self.phases.enter("forward", step)
        self.fault.at("forward", step)
        total = self.forward_backward(mine, step)
        self.phases.enter("step", step)
        self.fault.at("step", step)
        finite = bool(torch.isfinite(total)) or not config.check_finite
        interrupted, bad = self.stop.agree(finite)
        if bad:
            raise self._not_finite(bad)
        if self.step == self.start + 1 and not self.model_states:
            self.model_states = self.measure_model_states()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.schedule.step()
        dist.all_reduce(total, group=self.group)
        self.step = step
        self.history["step"].append(step)
        self.history["loss"].append(float(total) / self.dp)
        self.window_tokens += config.global_batch_size * config.seq_len
        return interrupted

    def forward_backward(self, mine: torch.Tensor, step: int) -> torch.Tensor:
        """The step's loss (this rank's mean): one pipeline step, or
        ``accumulation`` micro-batches, synchronised only after the last."""
        config = self.config
        if self.pipeline:
            batches = iter([{"input_ids": mine}])
            loss = self.booster.execute_pipeline(batches, self.model, None, self.optimizer)
            total: torch.Tensor = loss["loss"].detach().float()
            return total
        total = torch.zeros((), device=self.device)
        for k in range(config.accumulation):
            part = mine[k * self.micro : (k + 1) * self.micro]
            last = k == config.accumulation - 1
            sync: AbstractContextManager[None] = (
                nullcontext() if last else self.booster.no_sync(self.model, self.optimizer)
            )
            with sync:
                loss = self.model(input_ids=part, labels=part).loss / config.accumulation
                self.phases.enter("backward", step)
                self.fault.at("backward", step)
                self.booster.backward(loss, self.optimizer)
            total += loss.detach().float()
        return total

    def _not_finite(self, bad: list[int]) -> NonFiniteLossError:
        config, step = self.config, self.step
        saved = max((s for s in range(self.start, step + 1) if _periodic(config, s)), default=0)
        where = f"the last checkpoint is at step {saved}" if saved else "no checkpoint yet"
        when = (
            "stopped after the step (--step-in-backward steps inside backward; the "
            "weights in memory are not to be trusted, the checkpoints are)"
            if self.options.step_in_backward
            else "stopped before the optimizer step"
        )
        return NonFiniteLossError(
            f"step {step + 1}: the loss (or gradient norm) is not finite on rank(s) "
            f"{', '.join(map(str, bad))}; {when} "
            f"(--check-finite), {where}. Lower --lr, use bf16 rather than fp16, or "
            "--resume from an earlier checkpoint."
        )

    def measure_model_states(self) -> dict[str, float]:
        """Model states at their peak (this step's gradients held, the
        optimizer's states built by the step before), the largest over the
        ranks, beside pc-estimate's prediction."""
        from pc_train.estimate import measured_model_state_bytes

        held = torch.tensor([float(measured_model_state_bytes(self.model, self.optimizer))])
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        return {"measured": float(held), "predicted": float(self.predicted.model_state_bytes)}

    def log(self) -> None:
        """Advance the progress; every ``log_every`` steps (and the first
        and last) also record throughput, MFU and every rank's peak memory
        (collective) and write them to the progress and TensorBoard."""
        if self.progress is None:
            raise AssertionError("Trainer.log runs inside Trainer.run")
        config, step = self.config, self.step
        log = step % config.log_every == 0 or step == config.steps or step == self.start + 1
        fields = self._log_entry() if log else {}
        self.progress.update(step, config.steps, fields, log)

    def _log_entry(self) -> dict[str, str]:
        step = self.step
        mem, kind = _peak_memory(self.device)
        memories = [torch.zeros(1, dtype=torch.float64) for _ in range(self.env.world_size)]
        dist.all_gather(memories, torch.tensor([mem], dtype=torch.float64))
        now = time.perf_counter()
        rate = self.window_tokens / max(now - self.window_start, 1e-9)
        tflops = rate * self.flops_per_token / self.env.world_size / 1e12
        entry = {
            "step": step,
            "loss": self.history["loss"][-1],
            "tokens_per_s": rate,
            "tflops": tflops,
            "mfu": tflops * 1e12 / self.peak,
            "peak_memory": [float(m) for m in memories],
            "memory_kind": kind,
            "lr": self.schedule.get_last_lr()[0],
        }
        self.history["log"].append(entry)
        self.window_start, self.window_tokens = now, 0
        if self.writer is not None:
            for key in ("loss", "tokens_per_s", "tflops", "mfu", "lr"):
                self.writer.add_scalar(f"train/{key}", entry[key], step)
            for r, m in enumerate(entry["peak_memory"]):
                self.writer.add_scalar(f"memory/rank{r}_mib", m / 2**20, step)
        return {
            "loss": f"{entry['loss']:.4f}",
            "tok/s": f"{rate:,.0f}",
            "TFLOPS": f"{tflops:.3g}",
            "MFU": f"{entry['mfu']:.1%}",
            "mem": f"{max(entry['peak_memory']) / 2**20:,.0f}MiB",
        }

    def evaluate(self, step: int) -> float | None:
        """The held-out loss, averaged over the data-parallel ranks, into
        the history (collective); None under pipelines, where a step runs
        forward and backward together."""
        if self.pipeline:
            return None
        self.model.eval()
        with torch.no_grad():
            loss = self.model(input_ids=self.eval_ids, labels=self.eval_ids).loss.detach().float()
        self.model.train()
        dist.all_reduce(loss, group=self.group)
        mean = float(loss) / self.dp
        self.history["eval_step"].append(step)
        self.history["eval_loss"].append(mean)
        return mean

    def periodic_evaluate(self) -> None:
        """The evaluation every ``eval_every`` steps, logged to TensorBoard."""
        self.phases.enter("eval", self.step)
        self.fault.at("eval", self.step)
        loss = self.evaluate(self.step)
        if self.writer is not None and loss is not None:
            self.writer.add_scalar("eval/loss", loss, self.step)

    def save(self) -> None:
        """A checkpoint of this step (collective), now or, with
        --async-save, written in the background while training goes on
        (one at a time); rank 0 then keeps the newest ``keep_last``. The
        stall (how long training waited: the call, and for an async save
        the optimizer steps' waits for its host copy) goes into the
        history."""
        config, step = self.config, self.step
        began = time.perf_counter()
        with self.memory.phase("save", then="train"):
            self.finish_save()
            self.phases.enter("save", step)
            state = {"step": step, "history": self.history, "config": config.to_dict(),
                     "world": self.env.world_size, "resumed_at": self.resumed_at,
                     "schedule_steps": self.schedule_steps}  # fmt: skip
            self.pending_save = save_checkpoint(
                self.booster, self.model, self.optimizer, self.schedule, config.checkpoint_dir,
                step, copy.deepcopy(state), _rng_state(),
                written=partial(self.fault.at, "save", step), use_async=config.async_save,
                keep_last=config.keep_last,
            )  # fmt: skip
        stall = time.perf_counter() - began
        self.history.setdefault("save", []).append(
            {"step": step, "stall_s": stall, "async": config.async_save}
        )
        self.copy_waits = self.booster.async_save_waits

    def finish_save(self) -> None:
        """Wait for the checkpoint being written (raises its error); the
        steps' waits for its host copy join its stall."""
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.result()
            self.history["save"][-1]["stall_s"] += self.booster.async_save_waits - self.copy_waits

    def report(self, seconds: float) -> None:
        """Rank 0's report (report.json, report.md, plots) and last lines."""
        from pc_train.report import write_report

        config, history = self.config, self.history
        summary = {
            "model": self.spec.name,
            "plugin": self.options.describe(),
            "world": self.env.world_size,
            "backend": self.context.backend,
            "precision": config.precision,
            "params": self.shape.params,
            "steps": config.steps,
            "global_batch_size": config.global_batch_size,
            "seq_len": config.seq_len,
            "seconds": seconds,
            "peak_tflops": self.peak / 1e12,
            "peak_source": self.peak_source,
            "model_states": self.model_states,
            "memory_by_phase": self.memory_by_phase,
            "memory_kind": self.memory.kind,
            "resumed_at": self.resumed_at,
            "predicted_step_seconds": self.predicted.step_seconds,
            "config": config.to_dict(),
        }
        written = write_report(Path(config.output_dir), summary, history)
        losses = history["loss"]
        head = sum(losses[:10]) / min(10, len(losses))
        tail = sum(losses[-10:]) / min(10, len(losses))
        eval_text = ""
        if history["eval_loss"]:
            eval_text = (
                f", held-out loss {history['eval_loss'][0]:.3f} -> {history['eval_loss'][-1]:.3f}"
            )
        print(
            f"done in {seconds:.1f} s: train loss {head:.3f} -> {tail:.3f} (mean of first / last "
            f"10 steps){eval_text}\nreport: {', '.join(str(p) for p in written)}",
            flush=True,
        )


def train(
    config: TrainConfig,
    context: Any,
    reasons: Sequence[str] = (),
    phases: _Phases | None = None,
) -> dict[str, Any]:
    """Train on this rank (collective: every rank calls it). Returns the
    history (losses every step, logged throughput and memory). ``phases``
    publishes where this rank is, for failure reports."""
    return Trainer(config, context, reasons, phases).run()


def _periodic(config: TrainConfig, step: int) -> bool:
    return bool(config.checkpoint_every) and step % config.checkpoint_every == 0


# -- processes -------------------------------------------------------------------


def _leave(message: str, code: int) -> None:
    _note(message, overwrite=code != 143)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: destroying a group with a dead peer can abort


def _write_whole(path: Path, text: str) -> None:
    """Whole or not at all: the launcher may read while a stopped rank writes."""
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _note(message: str, overwrite: bool = False) -> None:
    """A line for our launcher to print once after a failure; under
    torchrun, printed by the rank."""
    rank = os.environ.get("RANK", "0")
    folder = os.environ.get(_ERROR_DIR)
    if not folder:
        print(f"pc-train (rank {rank}): {message}", file=sys.stderr, flush=True)
        return
    path = Path(folder, f"rank{rank}.txt")
    if overwrite or not path.exists():
        _write_whole(path, message)


# [Note: exit codes]
# 0: done. 1: a failure (a crash, a rank that died or stalled): the same
# command may succeed when run again, with --resume. 2: an error the user
# fixes before running again (bad settings or input, a full disk, a
# read-only or unwritable directory, a bad checkpoint, memory exhausted, a
# run that diverged): running it again as it is fails again, so a
# scheduler that restarts on failure should stop on 2. 130: interrupted
# (SIGINT / SIGTERM), a checkpoint saved. Each failed rank exits with its
# own code; the launcher exits 2 when any rank did, else 1.
EXIT_FAILURE = 1
EXIT_USER_ERROR = 2

# Raised by pc-train's own checks, with a message that says the fix.
_USER_ERRORS = (ValueError, TypeError, FileNotFoundError, MemoryError)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error`` (itself, or along its causes)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _disk_full(error: BaseException, out: Path) -> bool:
    """Whether ``error`` is a write that failed on a full disk. torch.save
    and DCP's writers say so in their own words, or only that a write came
    out short; a short write counts when the disk of ``out`` is (nearly) full."""
    text = str(error).lower()
    if "no space left" in text or "disk quota" in text:
        return True
    if "file write failed" not in text and "unexpected pos" not in text:
        return False
    try:
        usage = shutil.disk_usage(out)
    except OSError:
        return False
    return usage.free < max(256 * 2**20, usage.total // 100)


def describe_failure(error: BaseException, config: TrainConfig) -> tuple[int, str]:
    """(exit code, one line) for an exception that ended a rank: what it
    was, and the fix where the user has one."""
    kind = type(error).__name__
    text = " ".join(str(error).split()) or "(no message)"
    out = Path(config.output_dir)
    cause = _os_error(error)
    full = cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    if full or (cause is None and _disk_full(error, out)):
        where = Path(cause.filename) if cause is not None and cause.filename else out
        try:
            usage = shutil.disk_usage(where if where.exists() else out)
            room = f"{_bytes(usage.free)} free of {_bytes(usage.total)}"
        except OSError:
            room = "free space unknown"
        return EXIT_USER_ERROR, (
            f"{kind}: the disk is full writing {where} ({room}): {text}; free space there or "
            "pass --output-dir on a larger disk, then --resume."
        )
    if cause is not None and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where = cause.filename or out
        return EXIT_USER_ERROR, (
            f"{kind}: cannot write {where}: {_os_reason(cause)} ({text}); pass a writable "
            "--output-dir."
        )
    if isinstance(error, _USER_ERRORS):
        return EXIT_USER_ERROR, f"{kind}: {text}"
    return EXIT_FAILURE, f"{kind}: {text}"


def _traceback_file(config: TrainConfig, rank: int, error: BaseException) -> Path | None:
    """The traceback, for a bug report: in ``<output-dir>/logs``, else the
    temporary directory (a full or read-only disk); None if neither takes it."""
    text = "".join(traceback.format_exception(error))
    name = f"rank{rank}-error.log"
    for folder in (Path(config.output_dir) / "logs", Path(tempfile.gettempdir())):
        path = folder / name if folder.name == "logs" else folder / f"pc-train-{os.getpid()}-{name}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError:
            continue
        return path
    return None


def _fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    """Report an error once, without a traceback, and exit with ``code``."""
    folder = os.environ.get(_ERROR_DIR)
    if folder:  # our own launcher prints it once
        note = Path(folder, f"rank{os.environ.get('RANK', '0')}.txt")
        _write_whole(note, f"error: {message}")
    else:
        print(f"pc-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _worker(config: TrainConfig, reasons: Sequence[str]) -> None:
    from pc_comm import init_distributed

    # A forked worker inherits the launcher's handlers; a rank's own are
    # Python's defaults until the training loop installs _Stop's.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)

    # The Booster re-points the LR schedule at the optimizer it rebuilt;
    # torch's check for a wrapped step() cannot see that.
    warnings.filterwarnings("ignore", message=re.escape("Seems like `optimizer.step()` has been"))
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    context = init_distributed(
        timeout=timedelta(seconds=config.timeout), debug_collectives=config.debug_collectives
    )
    if context.device.type == "cpu":
        # Ranks share the host's cores; oversubscribing them slows every rank.
        torch.set_num_threads(_cpu_threads(context.env.local_world_size))
        tune_host_allocator()  # no page faults for memory freed last step [Note: host allocator]
    phases = _Phases()
    rank = context.env.rank
    try:
        join_memory_cgroup(rank)  # PC_TRAIN_CGROUP: the memory tests' per-rank caps
        train(config, context, reasons, phases)
    except Exception as error:  # every rank's first exception, in one line
        if isinstance(error, RuntimeError) and health.is_peer_failure(error):
            peer = isinstance(error, health.PeerFailureError)
            failure = error if peer else health.diagnose(error)
            _leave(f"error: {failure}", EXIT_FAILURE)
        code, text = describe_failure(error, config)
        if code == EXIT_FAILURE:  # not ours: the traceback goes to a file, for a bug report
            log = _traceback_file(config, rank, error)
            text += f" (traceback: {log})" if log else ""
        _fail(f"rank {rank} in {phases.current}: {text}", code)
    finally:
        health.stop_board()
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_failure(failure: Any, errors: Path, config: TrainConfig) -> None:
    """Say once what went wrong: the ranks' own messages, and which rank
    failed first (a rank killed by a signal other than the SIGTERM the
    launcher stops the others with, else the earliest)."""
    notes = sorted(errors.glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    messages = list(dict.fromkeys(p.read_text() for p in notes))  # by rank, each once
    failures = failure.failures
    codes = {f.exitcode for f in failures.values()}
    if codes == {130}:
        raise SystemExit(130)
    killed = [r for r, f in failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"]
    first = min(killed) if killed else min(failures, key=lambda r: failures[r].timestamp)
    cause = failures[first]
    how = (
        f"killed by {cause.signal_name()}" if cause.exitcode < 0 else f"exit code {cause.exitcode}"
    )
    for message in messages:
        print(f"pc-train: {message}", file=sys.stderr)
    if killed or not messages:
        latest = config.checkpoint_dir
        print(
            f"pc-train: rank {first} failed first ({how}); the launcher stopped the other "
            f"ranks. Checkpoints saved so far are in {latest}; continue with --resume.",
            file=sys.stderr,
        )
    raise SystemExit(
        EXIT_USER_ERROR if EXIT_USER_ERROR in codes else EXIT_FAILURE
    )  # [Note: exit codes]


def _start_method() -> str:
    """How the local workers start. ``fork`` where it is safe: a CPU-only
    torch on Linux, where the workers inherit the torch and transformers this
    process has imported already (several seconds less per start). It needs
    this process to have started no OpenMP thread team (GNU OpenMP hangs in a
    forked child) and no CUDA, which :func:`prepare` keeps with
    ``fork_safe``. Elsewhere ``spawn``, torch's default. ``PC_TRAIN_START_METHOD``
    overrides it."""
    chosen = os.environ.get("PC_TRAIN_START_METHOD")
    if chosen:
        if chosen not in ("fork", "spawn", "forkserver"):
            raise ValueError(
                f"PC_TRAIN_START_METHOD={chosen!r}; expected fork, spawn or forkserver."
            )
        return chosen
    cpu_only = torch.version.cuda is None and torch.version.hip is None
    return "fork" if sys.platform == "linux" and cpu_only else "spawn"


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    under_torchrun = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", config.nproc)) if under_torchrun else config.nproc
    try:
        start_method = "spawn" if under_torchrun else _start_method()
        threads = torch.get_num_threads()
        if start_method == "fork":
            torch.set_num_threads(1)  # no OpenMP team in a process that forks
        try:
            config, _, reasons = prepare(config, world, fork_safe=start_method == "fork")
        finally:
            torch.set_num_threads(threads)
    except (ValueError, CheckpointError) as error:
        print(f"pc-train: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    except OSError as error:  # reading the model, corpus or checkpoint
        code, text = describe_failure(error, config)
        print(f"pc-train: error: before any rank started: {text}", file=sys.stderr)
        raise SystemExit(code) from None
    if under_torchrun:  # join torchrun's job
        _worker(config, reasons)
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"pc-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    print(
        f"pc-train: starting {config.nproc} local process(es); output in {config.output_dir}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="pc-train-") as errors:
        os.environ[_ERROR_DIR] = errors
        try:
            elastic_launch(launch, _worker)(config, reasons)
        except ChildFailedError as failure:
            _report_failure(failure, Path(errors), config)
        except (KeyboardInterrupt, SignalException):
            print(
                f"pc-train: interrupted; continue from the last checkpoint in "
                f"{config.checkpoint_dir} with --resume.",
                file=sys.stderr,
            )
            raise SystemExit(130) from None
        finally:
            os.environ.pop(_ERROR_DIR, None)


if __name__ == "__main__":
    main()
