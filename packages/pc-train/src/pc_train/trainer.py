"""One rank's training run: :class:`Trainer`, whose methods are the steps
of the loop (build and :meth:`~Trainer.resume`, then
:meth:`~Trainer.train_step`, :meth:`~Trainer.log`,
:meth:`~Trainer.evaluate`, :meth:`~Trainer.save`, and rank 0's
:meth:`~Trainer.report`), and :func:`train`, which every rank calls. Every
step's global batch is a function of (seed, step), split over the
data-parallel ranks, so a resumed run sees the batches an uninterrupted one
would; checkpoints hold the model, optimizer, LR schedule, every rank's RNG
and the history, so with ``--deterministic`` (the default) a resumed run
repeats the loss curve bitwise."""

from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_booster import NonFiniteGradientError
from pc_train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_trainer_state,
    model_and_optimizer,
    model_config_dict,
    rank_file,
    refuse_linked_run_dirs,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from pc_train.cost import estimate, measured_model_state_bytes, model_shape
from pc_train.data import (
    batch_offsets,
    load_corpus,
    load_tokenizer,
    split_corpus,
    tokenizer_source,
    windows,
)
from pc_train.faults import FaultInjector
from pc_train.finite import (
    NonFiniteLossError,
    non_finite_gradient,
    non_finite_loss,
    periodic,
    plugin_max_norm,
)
from pc_train.hardware import peak_flops
from pc_train.memory import PhaseMemory, peak_memory
from pc_train.models import build_model, reads_pretrained_after_boost, resolve_model
from pc_train.progress import Progress, tensorboard_writer
from pc_train.report import closing_lines, write_report
from pc_train.signing import signing_key
from pc_train.stopping import Phases, Stop
from pc_train.train_config import TrainConfig

__all__ = ["NonFiniteLossError", "Trainer", "train"]


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
    if state is None or config.extend_schedule:
        return config.steps
    saved = state.get("schedule_steps", state.get("config", {}).get("steps", config.steps))
    return int(saved)


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
        phases: Phases | None = None,
    ) -> None:
        self.config = config
        # pc_comm.init_distributed's result: this rank's environment, device, backend.
        self.context = context
        self.env = context.env
        self.device: torch.device = context.device
        # Rank 0 prints, writes TensorBoard logs and the report.
        self.rank0 = self.env.rank == 0
        # Where this rank is, on pc-comm's health board, for failure reports.
        self.phases = phases or Phases()
        self.phases.enter("start-up")
        # With --resume: the checkpoint and its trainer state, checked.
        self.checkpoint: Path | None = None
        self.saved: dict[str, Any] | None = None
        # Every rank refuses a link where the run's files go (pc-train's
        # launcher did before any rank started) [Note: paths pc touches].
        refuse_linked_run_dirs(config)
        signing_key()  # a key too short to sign with is refused on every rank, at once
        if config.resume is not None:
            self.checkpoint = find_checkpoint(config.checkpoint_dir, config.resume)
            self.saved = load_trainer_state(self.checkpoint, config)
        # The run these checkpoints belong to: recorded at the first start,
        # kept on resume, signed with each checkpoint [Note: what a signature
        # binds]. Only rank 0's is written (it commits).
        self.run_id: str = str((self.saved or {}).get("run_id") or uuid.uuid4().hex)
        # The LR schedule's length, fixed by the run that started it.
        self.schedule_steps = _schedule_steps(config, self.saved)
        # Why --plugin auto chose the plugin; printed under the header.
        self.reasons = tuple(reasons)
        self._build()
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
        self._measure()
        # PC_TRAIN_FAULT: kill or stall this rank at one (step, phase), for fault tests.
        self.fault = FaultInjector()
        # Model states at their peak, measured in the first step this run
        # takes after one has built the optimizer's states; for the report.
        self.model_states: dict[str, float] = {}
        # Tokens trained since the last log line, and when that line was.
        self.window_start, self.window_tokens = 0.0, 0
        # Set by run(): a stop asked by SIGINT / SIGTERM, rank 0's progress
        # bar or lines, and its TensorBoard writer.
        self.stop: Stop | None = None
        self.progress: Progress | None = None
        self.writer: Any = None

    # -- building -------------------------------------------------------------

    def _build(self) -> None:
        """The plugin and its Booster, the corpus, the boosted model, optimizer
        and LR schedule, and the data-parallel split of the batch."""
        from pc_booster import Booster

        config = self.config
        self.spec = resolve_model(config.model, config.seq_len)
        self.options = config.plugin_options()
        self.plugin = self.options.make(plugin_max_norm(config, self.options), config.timeout)
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

    def _measure(self) -> None:
        """The held-out batch, the model's shape, pc-estimate's prediction
        the throughput is measured against, and (rank 0) the MFU's peak."""
        config = self.config
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
            peak_flops(self.device, self.env.local_world_size, config.precision)
            if self.rank0
            else (1.0, "")
        )

    def _load_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The corpus, its training part and its held-out part."""
        config, spec = self.config, self.spec
        tokenizer = load_tokenizer(tokenizer_source(config.tokenizer, spec.pretrained))
        tokens = load_corpus(config.corpus, config.corpus_bytes, tokenizer)
        return (tokens, *split_corpus(tokens, config.seq_len, spec.vocab_size))

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
        same_world = state["world"] == env.world_size
        if same_world:
            set_rng_state(rank_file(path, rng))
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
        self.stop = Stop(self.phases, grace=min(config.timeout + 2.0, 60.0))
        self.progress = Progress(config, self.start, self.rank0)
        self.writer = tensorboard_writer(config, self.rank0)
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
            if periodic(config, self.step) or interrupted or self.step == config.steps:
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
            raise non_finite_loss(config, self.start, self.step, bad, self.options.step_in_backward)
        if self.step == self.start + 1 and not self.model_states:
            self.model_states = self.measure_model_states()
        try:
            self.optimizer.step()
        except NonFiniteGradientError as error:  # on every rank: the norm is all-reduced
            raise non_finite_gradient(config, self.start, self.step, error) from None
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
                part_loss = self.model(input_ids=part, labels=part).loss / config.accumulation
                self.phases.enter("backward", step)
                self.fault.at("backward", step)
                if last:
                    part_loss = self.fault.poison(part_loss, step)
                self.booster.backward(part_loss, self.optimizer)
            total += part_loss.detach().float()
        return total

    def measure_model_states(self) -> dict[str, float]:
        """Model states at their peak (this step's gradients held, the
        optimizer's states built by the step before), the largest over the
        ranks, beside pc-estimate's prediction."""
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
        mem, kind = peak_memory(self.device)
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
                     "run_id": self.run_id,
                     "schedule_steps": self.schedule_steps,
                     "model_config": model_config_dict(self.spec.config)}  # fmt: skip
            self.pending_save = save_checkpoint(
                self.booster, self.model, self.optimizer, self.schedule, config.checkpoint_dir,
                step, copy.deepcopy(state), rng_state(),
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
            self.phases.enter("save", self.history["save"][-1]["step"])  # its error is that save's
            pending.result()
            self.history["save"][-1]["stall_s"] += self.booster.async_save_waits - self.copy_waits

    def report(self, seconds: float) -> None:
        """Rank 0's report (report.json, report.md, plots) and last lines."""
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
        print(closing_lines(history, seconds, written), flush=True)


def train(
    config: TrainConfig,
    context: Any,
    reasons: Sequence[str] = (),
    phases: Phases | None = None,
) -> dict[str, Any]:
    """Train on this rank (collective: every rank calls it). Returns the
    history (losses every step, logged throughput and memory). ``phases``
    publishes where this rank is, for failure reports."""
    return Trainer(config, context, reasons, phases).run()
