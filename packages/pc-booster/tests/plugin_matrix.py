"""The generated combination test of every plugin [Note: the plugin matrix].

[Note: the plugin matrix]
The option space is the product of plugin (and, for HybridParallelPlugin,
tp x pp x zero stage x schedule) x precision x clipping x accumulation x
construction (eager, ``LazyInitContext``) x the dtype the model is built in
x the optimizer (AdamW, or SGD with momentum: a wrong gradient scale, which
Adam's normalisation hides, moves SGD's parameters by that factor) x the
LR scheduler (none, built over the user's optimizer before ``boost`` as
Colossal-AI's examples build it, or over the returned one after).
Each combination runs through the public API exactly as a user's program
does (plugin constructor, ``Booster(mixed_precision=...)``, ``boost``,
``no_sync``, ``backward`` or ``execute_pipeline``, ``step``) and either

- is refused with a ValueError naming the plugin, before anything trains
  (the plugins raise these from their options' rules), or
- matches single-process training of the same model on the same global
  batch over ``STEPS`` steps: fp32 losses and every parameter at rtol
  1e-5 / atol 1e-6; bf16 / fp16 losses within ``LOW_PRECISION_RTOL`` of a
  single-process mixed-precision reference (fp32 masters, the loss scaled
  for fp16) and the parameter update's norm within 5 % of the fp32 run's.

Where pc-train and pc-estimate can express a combination, their verdict
(``prepare`` and ``pc-estimate``'s exit) must be the API's: the
integration test test_rules_agree.py compares them with :func:`verdict_rows`.

``PC_PLUGIN_MATRIX=full`` runs the whole space (``nox -s plugin_matrix``);
otherwise each test file runs its plugin's sample (:func:`sample`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    ParallelLayout,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_chunk import LazyInitContext
from pc_comm.testing import spawn

WORLD = 4
STEPS = 4
LR = 1e-4
# Adam's eps well above the clipped gradients' RMS, so that its update
# follows the gradient's size: a clip not applied (or applied by another
# norm) moves the parameters visibly; at 1e-8 Adam hides any uniform scale.
EPS = 1e-3
MAX_NORM = 0.05
SGD_LR = 0.05
SGD_MOMENTUM = 0.9
OPTIMIZERS = ("adamw", "sgd")
SCHEDULERS = ("none", "before", "after")  # the LR scheduler: built before / after boost
SCALE = 2.0**10
LOW_PRECISION_RTOL = {"bf16": 2e-2, "fp16": 5e-3}
UPDATE_NORM_RTOL = 0.05
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PER_RANK = 2  # sequences per data-parallel rank and micro-step

# plugin -> the names of its variants in the matrix
FAMILIES = {
    "ddp": ("torch-ddp", "ddp"),
    "low_level_zero": ("zero1", "zero2"),
    "torch_fsdp": ("torch-fsdp",),
    "gemini": ("gemini", "gemini-step-in-backward"),
    "hybrid": ("hybrid",),
}
HYBRID_LAYOUTS = [
    (tp, pp, zero, schedule)
    for tp, pp, zero in itertools.product((1, 2), (1, 2), (0, 1, 2))
    for schedule in (("1f1b", "interleaved", "zbv") if pp > 1 else ("1f1b",))
]


@dataclass(frozen=True)
class Case:
    plugin: str
    precision: str
    clip: bool
    accumulation: int
    lazy: bool
    model_dtype: str
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    optimizer: str = "adamw"
    scheduler: str = "none"

    def label(self) -> str:
        layout = (
            f" tp{self.tp} pp{self.pp} zero{self.zero} {self.schedule}"
            if self.plugin == "hybrid"
            else ""
        )
        return (
            f"{self.plugin}{layout} {self.precision} clip={int(self.clip)} "
            f"accum={self.accumulation} {'lazy' if self.lazy else 'eager'} "
            f"model={self.model_dtype} {self.optimizer} scheduler={self.scheduler}"
        )

    @property
    def pipeline(self) -> bool:
        return self.plugin == "hybrid" and self.pp > 1


def all_cases(families: Iterable[str]) -> list[Case]:
    """The option space of ``families``: every layout x precision x
    clipping x accumulation x construction x model dtype with AdamW and no
    scheduler, and every layout x precision x clipping with each other
    optimizer / scheduler pair (accumulation 1, eager, fp32 model).

    The optimizer and scheduler axes act on the step (the loss scale's
    unscaling and skipping, the clip, the count of applied steps), so they
    are crossed with the axes that change the step: precision and clipping,
    under every layout. Accumulation, lazy construction and the model's dtype
    act before it, and are crossed with everything but those two. The
    complete product (6,912 hybrid cases, about 80 minutes on 2 cores) would
    add only the pairs of a pre-step axis with SGD or a scheduler."""
    out = []
    plain = (("adamw", "none"),)
    turned = tuple(p for p in itertools.product(OPTIMIZERS, SCHEDULERS) if p not in plain)
    for family in families:
        for plugin in FAMILIES[family]:
            layouts = HYBRID_LAYOUTS if plugin == "hybrid" else [(1, 1, 0, "1f1b")]
            spaces = (
                itertools.product(
                    layouts, DTYPES, (False, True), (1, 2), (False, True), ("fp32", "bf16"), plain
                ),
                itertools.product(
                    layouts, DTYPES, (False, True), (1,), (False,), ("fp32",), turned
                ),
            )
            for layout, precision, clip, accumulation, lazy, dtype, (opt, sched) in itertools.chain(
                *spaces
            ):
                tp, pp, zero, schedule = layout
                case = Case(plugin, precision, clip, accumulation, lazy, dtype)
                out.append(
                    replace(
                        case,
                        tp=tp,
                        pp=pp,
                        zero=zero,
                        schedule=schedule,
                        optimizer=opt,
                        scheduler=sched,
                    )
                )
    return out


# The sample run by `nox -s tests`: every plugin x precision, once plain and
# once with every other axis turned (clipping, accumulation, lazy, bf16
# model, SGD, the scheduler built before boost); in mixed precision twice more
# on an fp32 model with SGD, the scheduler built before boost, and after it
# with clipping; for hybrid, a
# tensor-parallel, a pipeline and a tp x pp layout.
_SAMPLE_HYBRID = [
    (2, 1, 1, "1f1b"),
    (2, 1, 0, "1f1b"),
    (1, 2, 1, "1f1b"),
    (2, 2, 0, "1f1b"),
    (1, 2, 0, "interleaved"),
]


def sample(families: Iterable[str]) -> list[Case]:
    out = []
    for family in families:
        for plugin in FAMILIES[family]:
            layouts = _SAMPLE_HYBRID if plugin == "hybrid" else [(1, 1, 0, "1f1b")]
            for (tp, pp, zero, schedule), precision in itertools.product(layouts, DTYPES):
                # pipelines: no accumulation
                turned = (True, 1 if pp > 1 else 2, True, "bf16", "sgd", "before")
                variants = [(False, 1, False, "fp32", "adamw", "none"), turned]
                if precision != "fp32":  # a bf16 model's mixed precision may be refused
                    variants.append((False, 1, False, "fp32", "sgd", "before"))
                    variants.append((True, 1, False, "fp32", "sgd", "after"))
                if pp > 1 and schedule == "1f1b" and precision == "fp32":
                    # refused: accumulation
                    variants.append((False, 2, False, "fp32", "adamw", "none"))
                for clip, accumulation, lazy, dtype, opt, sched in variants:
                    out.append(
                        Case(
                            plugin,
                            precision,
                            clip,
                            accumulation,
                            lazy,
                            dtype,
                            tp,
                            pp,
                            zero,
                            schedule,
                            opt,
                            sched,
                        )
                    )
    return out


def cases_for(families: Iterable[str]) -> list[Case]:
    families = list(families)
    return all_cases(families) if os.environ.get("PC_PLUGIN_MATRIX") == "full" else sample(families)


# -- building ------------------------------------------------------------------------------


def build_model(case: Case, lazy: bool | None = None) -> GPT2LMHeadModel:
    """Tiny GPT-2 (4 blocks of 4 heads, dropout off), in the case's dtype."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    context = LazyInitContext() if (case.lazy if lazy is None else lazy) else nullcontext()
    with context:  # as from_config(config, torch_dtype=...) builds it
        model: GPT2LMHeadModel = GPT2LMHeadModel._from_config(
            config, dtype=DTYPES[case.model_dtype]
        )
    return model


def batch(step: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, 96, (size, 8), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def make_plugin(case: Case, layouts: dict[tuple[int, int], ParallelLayout]) -> Plugin:
    clip = MAX_NORM if case.clip else 0.0
    if case.plugin == "torch-ddp":
        return TorchDDPPlugin(max_norm=clip, initial_scale=SCALE, hysteresis=1)
    if case.plugin == "ddp":
        return DDPPlugin(max_norm=clip, initial_scale=SCALE, hysteresis=1)
    if case.plugin in ("zero1", "zero2"):
        return LowLevelZeroPlugin(
            stage=int(case.plugin[-1]), max_norm=clip, initial_scale=SCALE, hysteresis=1
        )
    if case.plugin == "torch-fsdp":
        return TorchFSDPPlugin(max_norm=clip, initial_scale=SCALE, hysteresis=1)
    if case.plugin.startswith("gemini"):
        return GeminiPlugin(
            max_norm=clip,
            step_in_backward=case.plugin.endswith("backward"),
            initial_scale=SCALE,
            hysteresis=1,
        )
    key = (case.tp, case.pp)
    plugin = HybridParallelPlugin(
        tp_size=case.tp,
        pp_size=case.pp,
        zero_stage=case.zero,
        num_microbatches=2,
        pp_style=case.schedule,
        max_norm=clip,
        layout=layouts.get(key),
        initial_scale=SCALE,
        hysteresis=1,
    )
    layouts.setdefault(key, plugin.layout)  # built once per (tp, pp), shared after
    return plugin


def make_optimizer(case: Case, params: Any) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def make_scheduler(optimizer: Any) -> torch.optim.lr_scheduler.LRScheduler:
    """A schedule that changes the rate at every step (1, 1/2, 1/3, ...)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# -- the reference -----------------------------------------------------------------------


def reference(
    case: Case, precision: str, global_batch: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: fp32, or ``precision``
    compute with fp32 masters (fp16: losses scaled by SCALE, overflowing
    steps skipped and the scale halved). Returns the losses and the final
    fp32 values."""
    built = build_model(case, lazy=False)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in built.named_parameters()}
    model = copy.deepcopy(built).to(DTYPES[precision])
    params = dict(model.named_parameters())
    optimizer = make_optimizer(case, masters.values())
    scheduler = make_scheduler(optimizer) if case.scheduler != "none" else None
    scale = SCALE if precision == "fp16" else 1.0
    losses = []
    for step in range(STEPS):
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(masters[name])
        loss = model(**batch(step, global_batch)).loss
        (loss * scale).backward()
        losses.append(loss.item())
        grads = {n: p.grad.float() / scale for n, p in params.items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        if not all(torch.isfinite(g).all() for g in grads.values()):
            scale /= 2
            if scheduler is not None:  # the user's loop steps it every iteration
                scheduler.step()
            continue
        for name, grad in grads.items():
            masters[name].grad = grad
        if case.clip:
            norm = torch.nn.utils.clip_grad_norm_(list(masters.values()), MAX_NORM)
            assert norm > MAX_NORM, f"the reference's gradient norm {norm} must exceed max_norm"
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    state = {n: t.detach().clone() for n, t in masters.items()}
    state.update({n: b.float() for n, b in built.named_buffers()})
    return losses, state


# -- one case through the API -----------------------------------------------------------


def _train(case: Case, booster: Booster, model: Any, optimizer: Any, scheduler: Any) -> list[float]:
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    per_rank = PER_RANK * case.accumulation
    losses = []
    for step in range(STEPS):
        full = batch(step, per_rank * dp)
        mine = {k: v[dp_rank * per_rank : (dp_rank + 1) * per_rank] for k, v in full.items()}
        if case.pipeline:
            loss = booster.execute_pipeline(iter([mine]), model, None, optimizer)["loss"]
        else:
            loss = torch.zeros(())
            for i in range(case.accumulation):
                part = {k: v[i * PER_RANK : (i + 1) * PER_RANK] for k, v in mine.items()}
                last = i == case.accumulation - 1
                with nullcontext() if last else booster.no_sync(model, optimizer):
                    micro = model(**part).loss / case.accumulation
                    booster.backward(micro, optimizer)
                loss = loss + micro.detach().float()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / dp)
    return losses


@dataclass(frozen=True)
class Verdict:
    case: Case
    refused: str | None  # the refusal's message; None: it trained and matched


def run_case(case: Case, layouts: dict[tuple[int, int], ParallelLayout]) -> Verdict:
    plugin: Plugin | None = None
    try:
        plugin = make_plugin(case, layouts)
        booster = Booster(plugin=plugin, mixed_precision=case.precision)
        model = build_model(case)
        optimizer = make_optimizer(case, model.parameters())
        scheduler = make_scheduler(optimizer) if case.scheduler == "before" else None
        model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
        if case.scheduler == "after":
            scheduler = make_scheduler(optimizer)
        if case.accumulation > 1:
            booster.no_sync(model, optimizer)  # its rules, before anything trains
    except ValueError as error:
        message = str(error)
        expected = type(plugin).__name__ if plugin is not None else "Plugin"
        assert expected in message or "Plugin:" in message, f"{case.label()}: {message}"
        return Verdict(case, message)
    losses = _train(case, booster, model, optimizer, scheduler)
    state = booster.plugin.model_state_dict(model)
    dp = dist.get_world_size(booster.plugin.dp_group)
    global_batch = PER_RANK * case.accumulation * dp
    ref_losses, ref_state = reference(case, case.precision, global_batch)
    what = case.label()
    if case.precision == "fp32":
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
            msg=lambda m: f"{what} losses: {m}",
        )  # fmt: skip
        for key, value in ref_state.items():
            label = f"{what} {key}"
            torch.testing.assert_close(
                state[key].float(), value, rtol=1e-5, atol=1e-6,
                msg=lambda m, label=label: f"{label}: {m}",  # type: ignore[misc]
            )  # fmt: skip
        return Verdict(case, None)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=LOW_PRECISION_RTOL[case.precision],
        atol=0.0, msg=lambda m: f"{what} losses: {m} (ours {losses}, reference {ref_losses})",
    )  # fmt: skip
    initial = {n: p.detach().float() for n, p in build_model(case, lazy=False).named_parameters()}
    _, fp32_state = reference(case, "fp32", global_batch)

    def update_norm(values: dict[str, torch.Tensor]) -> float:
        return math.sqrt(
            sum(float((values[n].float() - v).square().sum()) for n, v in initial.items())
        )

    ours, fp32 = update_norm(state), update_norm(fp32_state)
    assert abs(ours - fp32) <= UPDATE_NORM_RTOL * fp32, (
        f"{what}: parameter update norm {ours:.6g}, fp32 run's {fp32:.6g} (more than 5 % apart)"
    )
    return Verdict(case, None)


# -- verdicts only (what the API accepts), for comparison with pc-train ------------------


def api_verdict(case: Case, layouts: dict[tuple[int, int], ParallelLayout]) -> str | None:
    """The API's verdict without training: None if the plugin, Booster,
    boost and (with accumulation) no_sync accept the case, else the
    refusal's message."""
    try:
        plugin = make_plugin(case, layouts)
        booster = Booster(plugin=plugin, mixed_precision=case.precision)
        model = build_model(case)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, *_ = booster.boost(model, optimizer)
        if case.accumulation > 1:
            booster.no_sync(model, optimizer)
    except ValueError as error:
        return str(error)
    return None


def _verdicts(cases: list[Case], out: str) -> None:
    layouts: dict[tuple[int, int], ParallelLayout] = {}
    rows = [{**asdict(case), "reason": api_verdict(case, layouts)} for case in cases]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1))


def verdict_rows(cases: list[Case], out: Path, timeout: float = 900.0) -> list[dict[str, Any]]:
    """The API's verdict on each case (``reason`` None: accepted), at world 4."""
    spawn(_verdicts, WORLD, args=(cases, str(out)), timeout=timeout, name="plugin verdicts")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def _run_all(cases: list[Case], out: str) -> None:
    layouts: dict[tuple[int, int], ParallelLayout] = {}
    rows = []
    for index, case in enumerate(cases):
        try:
            verdict = run_case(case, layouts)
        except Exception as error:
            raise AssertionError(f"case {index + 1}/{len(cases)} {case.label()} failed") from error
        api = "ok" if verdict.refused is None else "refused"
        rows.append({**asdict(case), "result": api, "reason": verdict.refused})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1))


def run_matrix(
    families: Iterable[str], out: Path, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Run the cases of ``families`` at world 4 in one process group;
    return the rows (each case, "ok" or "refused" and the reason)."""
    cases = cases_for(families)
    if timeout is None:  # about 0.7 s a case at world 4 on 2 cores; 2x headroom
        timeout = max(600.0, 1.5 * len(cases))
    spawn(_run_all, WORLD, args=(cases, str(out)), timeout=timeout, name="plugin matrix")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    assert len(rows) == len(cases)
    # Every plugin trains in its plainest setting: a rule that refused
    # everything would otherwise pass.
    for family in families:
        for plugin in FAMILIES[family]:
            plain = [
                r for r in rows
                if r["plugin"] == plugin and r["precision"] == "fp32" and not r["clip"]
                and r["accumulation"] == 1 and r["zero"] == (1 if plugin == "hybrid" else 0)
            ]  # fmt: skip
            assert plain, f"no plain fp32 case for {plugin}"
            assert all(r["result"] == "ok" for r in plain if r["pp"] == 1 or r["zero"] != 2), plain
    for plugin, total, refused in refusal_counts(rows):  # shown with pytest -s
        print(f"plugin matrix: {plugin}: {total} cases, {total - refused} match, {refused} refused")
    return rows


def refusal_counts(rows: list[dict[str, Any]]) -> Iterator[tuple[str, int, int]]:
    """(plugin, cases, refused) per plugin."""
    for plugin in sorted({r["plugin"] for r in rows}):
        mine = [r for r in rows if r["plugin"] == plugin]
        yield plugin, len(mine), sum(r["result"] == "refused" for r in mine)
