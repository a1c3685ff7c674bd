"""Booster.save_model killed at any moment: the directory then loads as the
previous checkpoint or as the new one, whole, never a mix of the two, for
sharded and single-file saves and the switches between them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import pc_booster.checkpoint.files as checkpoint_files
from pc_booster import Booster, TorchDDPPlugin
from pc_comm.testing import spawn, tiny_gpt2

pytestmark = pytest.mark.timeout(120)


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


class _KillSwitch:
    """Let ``survives`` writes or removals through, then kill the save."""

    def __init__(self, survives: int) -> None:
        self.left = survives

    def wrap(self, real: Any) -> Any:
        def call(*args: Any) -> None:
            if self.left == 0:
                raise _Killed
            self.left -= 1
            real(*args)

        return call


def _state(booster: Booster, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in booster.plugin.model_state_dict(model).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save(booster: Booster, model: Any, out: Path, split: bool) -> None:
    """One model.safetensors, or transformers' sharded files with an index."""
    if split:
        booster.export_pretrained(model, out, size_per_shard=1)
    else:
        booster.save_model(model, out)


def _saves_killed_at_every_point(root: str) -> None:
    booster = Booster(plugin=TorchDDPPlugin())
    model = tiny_gpt2(n_embd=256)  # 11 shards of at most 1 MiB
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, *_ = booster.boost(model, optimizer)
    atomic, remove = checkpoint_files.atomic, checkpoint_files.remove
    for old_shard, new_shard in [(True, True), (False, False), (True, False), (False, True)]:
        base = Path(root) / f"base-{old_shard}-{new_shard}"
        _save(booster, model, base, old_shard)
        before = _state(booster, model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        after = _state(booster, model)
        kill_at, outcomes = 0, []
        while True:  # kill before the k-th write or removal, k = 0, 1, ... until it finishes
            target = Path(root) / f"case-{old_shard}-{new_shard}-{kill_at}"
            shutil.copytree(base, target)
            switch = _KillSwitch(kill_at)
            checkpoint_files.atomic = switch.wrap(atomic)
            checkpoint_files.remove = switch.wrap(remove)
            try:
                _save(booster, model, target, new_shard)
                finished = True
            except _Killed:
                finished = False
            finally:
                checkpoint_files.atomic, checkpoint_files.remove = atomic, remove
            booster.load_model(model, target)
            loaded = _state(booster, model)
            assert _same(loaded, before) or _same(loaded, after), (old_shard, new_shard, kill_at)
            outcomes.append("new" if _same(loaded, after) else "old")
            booster.load_model(model, base)  # back to the old weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            if finished:
                break
            kill_at += 1
        # Killed before the commit point: the old checkpoint; after it: the new.
        assert outcomes[0] == "old", outcomes
        assert outcomes[-1] == "new", outcomes
        assert outcomes == sorted(outcomes, key=["old", "new"].index), outcomes
        if new_shard:
            assert kill_at >= 7, kill_at  # really sharded: every shard was a kill point
        # A finished save leaves only its own files (no stale shards or index).
        files = sorted(p.name for p in target.iterdir() if not p.name.startswith("."))
        model_files = [f for f in files if f.startswith("model")]
        if new_shard:
            index = json.loads((target / "model.safetensors.index.json").read_text())
            shards = sorted(set(index["weight_map"].values()))
            assert model_files == sorted([*shards, "model.safetensors.index.json"]), files
        else:
            assert model_files == ["model.safetensors"], files
        assert "config.json" in files


def test_a_model_save_killed_anywhere_loads_old_or_new_never_a_mix(tmp_path: Path) -> None:
    spawn(_saves_killed_at_every_point, 1, args=(str(tmp_path),), timeout=100)
