"""Async sharded saves ([Note: async saves] in pc_booster.booster): the
call returns once this rank's share is copied; training steps on while
the write goes; the checkpoint then holds the values of the moment it was
asked for (model, optimizer states, hyperparameters), under every plugin
family, and loads under another plugin. A refused combination says why."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pc_booster import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests, tiny_gpt2

pytestmark = pytest.mark.timeout(300)

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch-ddp": TorchDDPPlugin,
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-fsdp": TorchFSDPPlugin,
    "gemini": GeminiPlugin,
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1),
}


def _step(booster: Booster, model: torch.nn.Module, optimizer: object, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()  # type: ignore[attr-defined]
    optimizer.zero_grad()  # type: ignore[attr-defined]


def _boosted(plugin: str, lr: float) -> tuple[Booster, torch.nn.Module, object]:
    booster = Booster(plugin=PLUGINS[plugin]())
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def check_async_save(root: str, plugin: str) -> None:
    booster, model, optimizer = _boosted(plugin, lr=1e-3)
    _step(booster, model, optimizer, 0)
    # Copies: a plugin's canonical state may share tensors with the live one.
    model_then = copy.deepcopy(booster.plugin.model_state_dict(model))
    optimizer_then = copy.deepcopy(booster.plugin.optimizer_state_dict(optimizer))
    out = Path(root) / plugin
    # The writes wait until training has stepped on: what they write must
    # be the copy made when they were asked for.
    gate, write = threading.Event(), Booster._save_sharded

    def held(*args: Any) -> None:
        assert gate.wait(60), "the test never opened the gate"
        write(*args)

    Booster._save_sharded = staticmethod(held)  # type: ignore[method-assign, assignment]
    try:
        saves = [
            booster.save_model(model, out / "model", shard=True, use_async=True),
            booster.save_optimizer(optimizer, out / "optimizer", shard=True, use_async=True),
        ]
        for seed in (1, 2):  # training goes on while the write does
            _step(booster, model, optimizer, seed)
        assert not any(s is None or s.done() for s in saves)
        gate.set()
        booster.wait_for_saves()
    finally:
        Booster._save_sharded = staticmethod(write)  # type: ignore[method-assign]
    assert all(s is not None and s.done() for s in saves)

    other, loaded, loaded_optimizer = _boosted("zero2", lr=5e-3)
    other.load_model(loaded, out / "model")
    other.load_optimizer(loaded_optimizer, out / "optimizer")
    state = other.plugin.model_state_dict(loaded)
    for key, value in model_then.items():
        torch.testing.assert_close(state[key].float(), value.float(), rtol=0, atol=0)
    moments = other.plugin.optimizer_state_dict(loaded_optimizer)
    for name, entry in optimizer_then["state"].items():
        for key, value in entry.items():
            got = torch.as_tensor(moments["state"][name][key]).float()
            torch.testing.assert_close(got, torch.as_tensor(value).float(), rtol=0, atol=0)
    assert {g["lr"] for g in moments["param_groups"]} == {1e-3}


def test_async_saves_hold_the_values_asked_for(tmp_path: Path) -> None:
    run_subtests(check_async_save, 2, {"plugin": list(PLUGINS)}, args=(str(tmp_path),),
                 timeout=280)  # fmt: skip


def check_refusal(root: str) -> None:
    booster, model, _ = _boosted("zero2", lr=1e-3)
    with pytest.raises(ValueError, match="pass shard=True"):
        booster.save_model(model, Path(root) / "single", use_async=True)
    dist.barrier()


def test_async_needs_the_sharded_form(tmp_path: Path) -> None:
    run_subtests(check_refusal, 2, {}, args=(str(tmp_path),), timeout=120)
