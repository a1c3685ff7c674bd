"""``pc-train``: train a ``transformers`` causal LM with any pc plugin.

Run it plainly and it starts ``--nproc`` local processes itself through
torch's elastic launcher; run it under ``torchrun`` and it joins the job
torchrun started (any number of nodes). Every step's global batch is a
function of (seed, step), split over the data-parallel ranks, so a resumed
run sees the batches an uninterrupted one would; checkpoints hold the
model, optimizer, LR schedule, every rank's RNG and the history, so with
``--deterministic`` (the default) a resumed run repeats the loss curve
bitwise. See docs/packages/pc-booster.md for the tour.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_booster.booster import _atomic
from pc_booster.checkpoint import (
    CheckpointError,
    find_checkpoint,
    has_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
)
from pc_booster.data import batch_offsets, load_byte_corpus, load_corpus, windows
from pc_booster.faults import FaultInjector
from pc_booster.models import MODEL_PRESETS, ModelSpec, build_model, resolve_model
from pc_booster.train_config import TrainConfig, parse_args
from pc_comm import health, tune_host_allocator

__all__ = [
    "MODEL_PRESETS",
    "NonFiniteLossError",
    "TrainConfig",
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
        self.current = "start"

    def enter(self, phase: str, step: int) -> None:
        current = f"{phase} of step {step}"
        if current != self.current:  # accumulation re-enters backward
            self.current = current
            health.set_phase(current)


class _Stop:
    """SIGINT / SIGTERM ask for a stop; the ranks agree on the step, save a
    checkpoint there and exit. The same tiny all-reduce, once per step
    before the optimizer steps, carries each rank's finite-loss check."""

    def __init__(self, phases: _Phases, grace: float) -> None:
        self.asked = False
        self.phases = phases
        self.grace = grace  # after SIGTERM, seconds to reach the step's end and save
        self.timer: threading.Timer | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = True
        if signum == signal.SIGTERM and self.timer is None:
            # A scheduler's preemption or the launcher stopping the job after
            # another rank failed. A rank blocked on a dead peer never reaches
            # the step's end: leave after the grace period, saying where it was.
            where = self.phases.current
            message = f"rank {self.phases.rank} was in {where} when the launcher stopped it."
            self.timer = threading.Timer(self.grace, _leave, args=(message, 143))
            self.timer.daemon = True
            self.timer.start()

    def agree(self, finite: bool) -> tuple[bool, list[int]]:
        """(stop asked on any rank, ranks whose loss is not finite)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(world + 1)
        flags[0] = 1.0 if self.asked else 0.0
        flags[1 + rank] = 0.0 if finite else 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), [r for r in range(world) if flags[1 + r] > 0]


def prepare(
    config: TrainConfig, world: int, *, fork_safe: bool = False
) -> tuple[TrainConfig, ModelSpec, list[str]]:
    """Check everything that can be checked before a process starts, and
    resolve ``--plugin auto``. Raises ValueError with the fix. ``fork_safe``:
    the caller forks its workers afterwards (see :func:`_start_method`)."""
    from pc_booster.estimate import DeviceInfo, model_shape, recommend
    from pc_booster.options import PluginKind, PluginOptions

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
    if config.resume == "auto":  # restarts of one command line: resume when there is one
        config = replace(config, resume="latest" if has_checkpoint(config.checkpoint_dir) else None)
    if config.resume is not None:
        path = find_checkpoint(config.checkpoint_dir, config.resume)
        load_trainer_state(path, config)  # raises CheckpointError on a bad checkpoint
    return config, spec, reasons


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


def _schedule(config: TrainConfig) -> Any:
    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / config.warmup) if config.warmup else 1.0
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))

    return factor


def _tokenizer(config: TrainConfig, spec: ModelSpec) -> Any:
    source = config.tokenizer
    files = ("tokenizer.json", "tokenizer_config.json")
    if source is None and spec.pretrained is not None:
        pretrained = spec.pretrained
        source = str(pretrained) if any((pretrained / f).exists() for f in files) else None
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


def train(
    config: TrainConfig,
    context: Any,
    reasons: Sequence[str] = (),
    phases: _Phases | None = None,
) -> dict[str, Any]:
    """Train on this rank (collective: every rank calls it). Returns the
    history (losses every step, logged throughput and memory). ``phases``
    publishes where this rank is, for failure reports."""
    from pc_booster import Booster, HybridParallelPlugin
    from pc_booster.estimate import DeviceInfo, estimate, measured_model_state_bytes, model_shape

    env, device = context.env, context.device
    rank0 = env.rank == 0
    spec = resolve_model(config.model, config.seq_len)
    options = config.plugin_options()
    plugin = options.make(config.clip_norm, config.timeout)
    booster = Booster(
        plugin=plugin, mixed_precision=None if config.precision == "fp32" else config.precision
    )
    pipeline = isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1

    tokens = load_corpus(config.corpus, config.corpus_bytes, _tokenizer(config, spec))
    if int(tokens.max()) >= spec.vocab_size:
        raise ValueError(
            f"the tokenizer makes ids up to {int(tokens.max())}, beyond the model's vocabulary "
            f"({spec.vocab_size}); use a model with a matching vocabulary."
        )
    split = int(len(tokens) * 0.95)
    train_tokens, eval_tokens = tokens[:split], tokens[split:]

    model = build_model(spec, config.seed, device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    model, optimizer, _, _, schedule = booster.boost(model, optimizer, lr_scheduler=schedule)
    group = plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    per_rank = config.global_batch_size // dp
    micro = per_rank // config.accumulation

    history: dict[str, Any] = {"step": [], "loss": [], "log": [], "eval_step": [], "eval_loss": []}
    start, resumed_at = 0, []
    if config.resume is not None:
        path = find_checkpoint(config.checkpoint_dir, config.resume)
        state = load_trainer_state(path, config)
        try:
            booster.load_model(model, path)
            booster.load_optimizer(optimizer, path / "optimizer.pt")
            booster.load_lr_scheduler(schedule, path / "scheduler.pt")
        except Exception as error:  # a checkpoint that passed the checks but will not load
            raise CheckpointError(f"checkpoint {path} does not load: {error}") from None
        rng = path / f"rng-rank{env.rank}.pt"
        if state["world"] == env.world_size and rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        elif rank0:
            print(
                f"pc-train: saved at world {state['world']}, resumed at {env.world_size}: RNG "
                "states start fresh (the loss curve may differ in the last bits)",
                flush=True,
            )
        start = state["step"]
        history = state["history"]
        resumed_at = [*state.get("resumed_at", []), start]

    eval_ids = windows(
        eval_tokens,
        torch.linspace(0, len(eval_tokens) - config.seq_len - 1, 32).long(),
        config.seq_len,
    )
    eval_mine = eval_ids[dp_rank * (32 // dp) : (dp_rank + 1) * (32 // dp)].to(device)

    def evaluate(step: int) -> None:
        if pipeline:
            return  # a pipeline step runs forward and backward together
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=eval_mine, labels=eval_mine).loss.detach().float()
        model.train()
        dist.all_reduce(loss, group=group)
        history["eval_step"].append(step)
        history["eval_loss"].append(float(loss) / dp)

    shape = model_shape(spec)
    predicted = estimate(shape, options, env.world_size, micro, config.seq_len, config.precision)
    flops_per_token = predicted.flops_per_step / predicted.tokens_per_step
    peak = DeviceInfo.detect(env.local_world_size, config.precision).peak_flops if rank0 else 1.0
    peak_source = "datasheet" if device.type == "cuda" else "measured matmul"
    if rank0:
        print(
            f"pc-train: {spec.name} ({shape.params / 1e6:.2f} M params) with "
            f"{options.describe()} on {env.world_size} {context.backend} rank(s), global batch "
            f"{config.global_batch_size} x {config.seq_len} tokens, "
            f"{len(tokens) / 1e6:.2f} M-token corpus",
            flush=True,
        )
        for reason in reasons:
            print(f"  plugin auto: {reason}", flush=True)
    phases = phases or _Phases()
    fault = FaultInjector()
    if start == 0:
        phases.enter("eval", 0)
        evaluate(0)

    # After SIGTERM, a rank blocked on a failed peer gets its own timeout,
    # plus a margin, to say where it is before it leaves.
    stop = _Stop(phases, grace=min(config.timeout + 2.0, 60.0))
    progress = _Progress(config, start, rank0)
    writer = _writer(config, rank0)
    model_states: dict[str, float] = {}
    began = time.perf_counter()
    window_start, window_tokens = time.perf_counter(), 0
    step = start
    interrupted = False
    while step < config.steps:
        offsets = batch_offsets(
            config.seed, step, config.global_batch_size, config.seq_len, len(train_tokens)
        )
        mine = windows(
            train_tokens, offsets[dp_rank * per_rank : (dp_rank + 1) * per_rank], config.seq_len
        ).to(device)
        phases.enter("forward", step + 1)
        fault.at("forward", step + 1)
        if pipeline:
            loss = booster.execute_pipeline(iter([{"input_ids": mine}]), model, None, optimizer)[
                "loss"
            ]
            total = loss.detach().float()
        else:
            total = torch.zeros((), device=device)
            for k in range(config.accumulation):
                part = mine[k * micro : (k + 1) * micro]
                last = k == config.accumulation - 1
                sync: AbstractContextManager[None] = (
                    nullcontext() if last else booster.no_sync(model, optimizer)
                )
                with sync:
                    loss = model(input_ids=part, labels=part).loss / config.accumulation
                    phases.enter("backward", step + 1)
                    fault.at("backward", step + 1)
                    booster.backward(loss, optimizer)
                total += loss.detach().float()
        phases.enter("step", step + 1)
        fault.at("step", step + 1)
        finite = bool(torch.isfinite(total)) or not config.check_finite
        interrupted, bad = stop.agree(finite)
        if bad:
            saved = max((s for s in range(start, step + 1) if _periodic(config, s)), default=0)
            where = f"the last checkpoint is at step {saved}" if saved else "no checkpoint yet"
            when = (
                "stopped after the step (--step-in-backward steps inside backward; the "
                "weights in memory are not to be trusted, the checkpoints are)"
                if options.step_in_backward
                else "stopped before the optimizer step"
            )
            raise NonFiniteLossError(
                f"step {step + 1}: the loss (or gradient norm) is not finite on rank(s) "
                f"{', '.join(map(str, bad))}; {when} "
                f"(--check-finite), {where}. Lower --lr, use bf16 rather than fp16, or "
                "--resume from an earlier checkpoint."
            )
        if step == start + 1 and not model_states:
            # Model states at their peak: this step's gradients held, the
            # optimizer's states built by the step before.
            held = torch.tensor([float(measured_model_state_bytes(model, optimizer))])
            dist.all_reduce(held, op=dist.ReduceOp.MAX)
            model_states = {
                "measured": float(held),
                "predicted": float(predicted.model_state_bytes),
            }
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        dist.all_reduce(total, group=group)
        step += 1
        history["step"].append(step)
        history["loss"].append(float(total) / dp)
        window_tokens += config.global_batch_size * config.seq_len
        log = step % config.log_every == 0 or step == config.steps or step == start + 1
        fields: dict[str, str] = {}
        if log:
            mem, kind = _peak_memory(device)
            memories = [torch.zeros(1, dtype=torch.float64) for _ in range(env.world_size)]
            dist.all_gather(memories, torch.tensor([mem], dtype=torch.float64))
            now = time.perf_counter()
            rate = window_tokens / max(now - window_start, 1e-9)
            tflops = rate * flops_per_token / env.world_size / 1e12
            entry = {
                "step": step,
                "loss": history["loss"][-1],
                "tokens_per_s": rate,
                "tflops": tflops,
                "mfu": tflops * 1e12 / peak,
                "peak_memory": [float(m) for m in memories],
                "memory_kind": kind,
                "lr": schedule.get_last_lr()[0],
            }
            history["log"].append(entry)
            window_start, window_tokens = now, 0
            fields = {
                "loss": f"{entry['loss']:.4f}",
                "tok/s": f"{rate:,.0f}",
                "TFLOPS": f"{tflops:.3g}",
                "MFU": f"{entry['mfu']:.1%}",
                "mem": f"{max(entry['peak_memory']) / 2**20:,.0f}MiB",
            }
            if writer is not None:
                for key in ("loss", "tokens_per_s", "tflops", "mfu", "lr"):
                    writer.add_scalar(f"train/{key}", entry[key], step)
                for r, m in enumerate(entry["peak_memory"]):
                    writer.add_scalar(f"memory/rank{r}_mib", m / 2**20, step)
        progress.update(step, config.steps, fields, log)
        if config.eval_every and step % config.eval_every == 0 and step < config.steps:
            phases.enter("eval", step)
            fault.at("eval", step)
            evaluate(step)
            if writer is not None:
                writer.add_scalar("eval/loss", history["eval_loss"][-1], step)
        if _periodic(config, step) or interrupted or step == config.steps:
            phases.enter("save", step)
            state = {"step": step, "history": history, "config": config.to_dict(),
                     "world": env.world_size, "resumed_at": resumed_at}  # fmt: skip
            save_checkpoint(
                booster, model, optimizer, schedule, config.checkpoint_dir, step, state,
                _rng_state(), written=partial(fault.at, "save", step),
            )  # fmt: skip
            if rank0:
                prune_checkpoints(config.checkpoint_dir, config.keep_last)
            dist.barrier()
        if interrupted:
            break
    progress.close()
    if interrupted:
        if rank0:
            print(
                f"pc-train: interrupted at step {step}; saved "
                f"{config.checkpoint_dir / f'step-{step:06d}'}. Continue with --resume.",
                flush=True,
            )
        raise SystemExit(130)
    evaluate(step)
    if writer is not None:
        writer.close()
    seconds = time.perf_counter() - began
    if rank0:
        from pc_booster.report import write_report

        summary = {
            "model": spec.name,
            "plugin": options.describe(),
            "world": env.world_size,
            "backend": context.backend,
            "precision": config.precision,
            "params": shape.params,
            "steps": config.steps,
            "global_batch_size": config.global_batch_size,
            "seq_len": config.seq_len,
            "seconds": seconds,
            "peak_tflops": peak / 1e12,
            "peak_source": peak_source,
            "model_states": model_states,
            "resumed_at": resumed_at,
            "predicted_step_seconds": predicted.step_seconds,
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
    return history


def _periodic(config: TrainConfig, step: int) -> bool:
    return bool(config.checkpoint_every) and step % config.checkpoint_every == 0


# -- processes -------------------------------------------------------------------


def _leave(message: str, code: int) -> None:
    _note(message, overwrite=code != 143)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: destroying a group with a dead peer can abort


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
        # Whole or not at all: the launcher may read while a stopped rank writes.
        _atomic(path, lambda p: p.write_text(message))


def _fail(message: str) -> None:
    """Report a user-facing error once, without a traceback."""
    folder = os.environ.get(_ERROR_DIR)
    if folder:  # our own launcher prints it once
        note = Path(folder, f"rank{os.environ.get('RANK', '0')}.txt")
        _atomic(note, lambda p: p.write_text(f"error: {message}"))
    else:
        print(
            f"pc-train: error (rank {os.environ.get('RANK', '0')}): {message}",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(1)


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
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // context.env.local_world_size))
        tune_host_allocator()  # no page faults for memory freed last step [Note: host allocator]
    phases = _Phases()
    try:
        train(config, context, reasons, phases)
    except (ValueError, TypeError, FileNotFoundError) as error:  # CheckpointError and
        # NonFiniteLossError are ValueErrors
        _fail(str(error))
    except RuntimeError as error:
        if not health.is_peer_failure(error):
            raise
        failure = error if isinstance(error, health.PeerFailureError) else health.diagnose(error)
        _leave(f"error: {failure}", 1)
    finally:
        health.stop_board()
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_failure(failure: Any, errors: Path, config: TrainConfig) -> None:
    """Say once what went wrong: the ranks' own messages, and which rank
    failed first (a rank killed by a signal other than the SIGTERM the
    launcher stops the others with, else the earliest)."""
    messages = sorted({p.read_text() for p in errors.glob("rank*.txt")})
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
    raise SystemExit(1)


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
        raise SystemExit(2) from None
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
