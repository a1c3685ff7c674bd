"""Checkpoint interoperability: a GPT-2 trained 2 steps and saved (model and
optimizer, the full form and the sharded one) under each plugin at world
size 2 (tp 2 x pp 2 at 4) loads under every plugin at world sizes 1, 2 and
4, and 2 more steps give the losses of an uninterrupted single-process
run; the loading optimizer is built with another learning rate, which the
load must replace. The saved model also loads with ``transformers``'
``from_pretrained`` and gives the same logits."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from booster_models import batch, build
from transformers import GPT2LMHeadModel

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(900)

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch-ddp": TorchDDPPlugin,
    "ddp": DDPPlugin,
    "zero1": lambda: LowLevelZeroPlugin(stage=1),
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-fsdp": TorchFSDPPlugin,
    "gemini": GeminiPlugin,
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1),
    "hybrid-tp2-sp": lambda: HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True),
    "hybrid-pp2-zero1": lambda: HybridParallelPlugin(pp_size=2, zero_stage=1, num_microbatches=2),
    "hybrid-pp2": lambda: HybridParallelPlugin(pp_size=2, num_microbatches=2),
    "hybrid-tp2-pp2-zero1": lambda: HybridParallelPlugin(
        tp_size=2, pp_size=2, zero_stage=1, num_microbatches=2
    ),
}
GLOBAL_BATCH, SAVED_AT, LR = 4, 2, 1e-4
# The world each plugin saves at (default 2): tp x pp.
SAVE_WORLD = {"hybrid-tp2-pp2-zero1": 4}


def _adamw(model: torch.nn.Module, lr: float = LR) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.01)


def _train(
    booster: Booster, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range
) -> list[float]:
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    per = GLOBAL_BATCH // dp
    losses = []
    for step in steps:
        full = batch("gpt2", step, size=GLOBAL_BATCH)
        mine = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in full.items()}
        plugin = booster.plugin
        if isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1:
            loss = booster.execute_pipeline(iter([mine]), model, None, optimizer)["loss"]
        else:
            loss = model(**mine).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / dp)
    return losses


def save_under(plugin: str, root: str) -> None:
    booster = Booster(plugin=PLUGINS[plugin]())
    model = build("gpt2")
    model, optimizer, *_ = booster.boost(model, _adamw(model))
    _train(booster, model, optimizer, range(SAVED_AT))
    if plugin == "zero1":  # transformers' sharded layout, with its index
        booster.export_pretrained(model, Path(root) / plugin, size_per_shard=1)
    else:
        booster.save_model(model, Path(root) / plugin)
    booster.save_optimizer(optimizer, Path(root) / plugin / "optimizer.pt")
    # The sharded form: every rank writes only its share.
    booster.save_model(model, Path(root) / plugin / "sharded", shard=True)
    booster.save_optimizer(optimizer, Path(root) / plugin / "sharded-optimizer", shard=True)


def load_under(saved: str, plugin: str, root: str) -> None:
    world = dist.get_world_size()
    if plugin.startswith("hybrid") and world % SAVE_WORLD.get(plugin, 2):
        return  # tp x pp must divide the world
    forms = {"full": ("", "optimizer.pt"), "sharded": ("sharded", "sharded-optimizer")}
    for form, (model_dir, optimizer_path) in forms.items():
        booster = Booster(plugin=PLUGINS[plugin]())
        model = build("gpt2", seed=7)  # different weights: the load must replace them
        # Another learning rate: the load must bring the saved one back.
        model, optimizer, *_ = booster.boost(model, _adamw(model, lr=3 * LR))
        booster.load_model(model, Path(root) / saved / model_dir)
        booster.load_optimizer(optimizer, Path(root) / saved / optimizer_path)
        losses = _train(booster, model, optimizer, range(SAVED_AT, SAVED_AT + 2))
        expected = json.loads((Path(root) / "reference.json").read_text())["losses"][SAVED_AT:]
        label = f"{form} saved under {saved}, loaded under {plugin} at world {world}"
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(expected),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, label=label: f"{label}: {m}",  # type: ignore[misc]
        )


def _reference(root: Path) -> GPT2LMHeadModel:
    """The uninterrupted run, in this process: its losses for every step,
    and the model as it was when the others saved."""
    model = build("gpt2")
    optimizer = _adamw(model)
    losses, saved = [], None
    for step in range(SAVED_AT + 2):
        if step == SAVED_AT:
            saved = copy.deepcopy(model)
        loss = model(**batch("gpt2", step, size=GLOBAL_BATCH)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    (root / "reference.json").write_text(json.dumps({"losses": losses}))
    assert isinstance(saved, GPT2LMHeadModel)
    return saved


def _save_all(tmp_path: Path) -> None:
    """Every plugin's checkpoint, and its consolidated export checked to be a
    transformers checkpoint."""
    saved_model = _reference(tmp_path)
    for world in sorted(set(SAVE_WORLD.values()) | {2}):
        plugins = [p for p in PLUGINS if SAVE_WORLD.get(p, 2) == world]
        run_subtests(_save_case, world, {"plugin": plugins}, args=(str(tmp_path),), timeout=300)
    ids = batch("gpt2", 99, size=2)["input_ids"]
    with torch.no_grad():
        expected = saved_model(ids).logits
        for plugin in PLUGINS:
            loaded = GPT2LMHeadModel.from_pretrained(tmp_path / plugin)
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_checkpoints_load_across_plugins_and_world_sizes(tmp_path: Path) -> None:
    """Every plugin loads, at worlds 1, 2 and 4, the checkpoint of another
    plugin, the pairs rotating with the world so each plugin loads three
    others' (33 loads; the whole 11 x 11 x 3 matrix is the next test, in
    ``nox -s scale``)."""
    _save_all(tmp_path)
    names = list(PLUGINS)
    for shift, world in enumerate((1, 2, 4), start=1):
        pairs = [f"{names[(i + shift) % len(names)]}>{p}" for i, p in enumerate(names)]
        run_subtests(_pair_case, world, {"pair": pairs}, args=(str(tmp_path),), timeout=600)


@pytest.mark.scale
def test_checkpoints_load_across_every_pair_of_plugins(tmp_path: Path) -> None:
    _save_all(tmp_path)
    for world in (1, 2, 4):
        run_subtests(
            _load_case,
            world,
            {"saved": list(PLUGINS), "plugin": list(PLUGINS)},
            args=(str(tmp_path),),
            timeout=600,
        )


def _pair_case(root: str, pair: str) -> None:
    saved, plugin = pair.split(">")
    load_under(saved, plugin, root)


def _save_case(root: str, plugin: str) -> None:
    save_under(plugin, root)


def _load_case(root: str, saved: str, plugin: str) -> None:
    load_under(saved, plugin, root)
