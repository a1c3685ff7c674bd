"""Async sharded saves ([Note: async saves] in pc_booster.checkpoint.async_saves): the
call returns at once; the copy of this rank's share is made beside the
next forward and backward, and the next optimizer step waits for it;
training steps on while the write goes; the checkpoint then holds the
values of the moment it was asked for (model, module buffers a forward
changes, optimizer states, hyperparameters), under every plugin family
(Gemini stepping inside backward too), and loads under another plugin. A
refused combination says why."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pc_booster.checkpoint.files as checkpoint_files
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
    "gemini-step-in-backward": lambda: GeminiPlugin(step_in_backward=True),
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1),
}


def _step(
    booster: Booster, model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int
) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _boosted(plugin: str, lr: float) -> tuple[Booster, torch.nn.Module, torch.optim.Optimizer]:
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
    gate, write = threading.Event(), checkpoint_files.save_sharded

    def held(*args: Any) -> None:
        assert gate.wait(60), "the test never opened the gate"
        write(*args)

    checkpoint_files.save_sharded = held  # type: ignore[assignment]
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
        checkpoint_files.save_sharded = write
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


class _Counting(torch.nn.Module):
    """A model with a large buffer that every forward changes in place."""

    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.register_buffer("seen", torch.zeros(70_000))  # above the copy-at-the-call size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1.0)
        out: torch.Tensor = self.body(x)
        return out.square().mean()


def check_copy_beside_training(root: str, plugin: str) -> None:
    """The copy is held back until after a forward has changed the buffer
    and a backward has run; the step then waits for it, and the checkpoint
    holds the values of the call."""
    from pc_booster.plugins import sharded

    booster = Booster(plugin=PLUGINS[plugin]())
    torch.manual_seed(0)
    model = _Counting()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, *_ = booster.boost(model, optimizer)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        booster.backward(model(x), optimizer)
        optimizer.step()
        optimizer.zero_grad()

    step()
    then = copy.deepcopy(booster.plugin.model_state_dict(model))
    gate, copy_state = threading.Event(), sharded.staged

    def late(*args: Any) -> Any:
        assert gate.wait(60), "the test never opened the gate"
        return copy_state(*args)

    sharded.staged = late  # type: ignore[assignment]
    try:
        waited = booster.async_save_waits
        out = Path(root) / f"beside-{plugin}"
        save = booster.save_model(model, out, shard=True, use_async=True)
        assert save is not None
        booster.backward(model(x), optimizer)  # runs while the copy is held back
        assert not save.done()
        threading.Timer(0.3, gate.set).start()
        optimizer.step()  # waits for the copy
        optimizer.zero_grad()
        assert booster.async_save_waits - waited >= 0.25, "the step did not wait for the copy"
        booster.wait_for_saves()
    finally:
        sharded.staged = copy_state
    now = booster.plugin.model_state_dict(model)
    assert not torch.equal(now["seen"], then["seen"])  # the training did change them
    assert not torch.equal(now["body.0.weight"], then["body.0.weight"])
    other = Booster(plugin=LowLevelZeroPlugin(stage=2))
    torch.manual_seed(1)
    fresh = _Counting()
    fresh, *_ = other.boost(fresh, torch.optim.AdamW(fresh.parameters()))
    other.load_model(fresh, out)
    loaded = other.plugin.model_state_dict(fresh)
    for key, value in then.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


def test_async_copies_run_beside_training(tmp_path: Path) -> None:
    run_subtests(check_copy_beside_training, 2, {"plugin": ["torch-ddp", "zero2", "gemini"]},
                 args=(str(tmp_path),), timeout=200)  # fmt: skip


def check_single_file(root: str) -> None:
    booster, model, _ = _boosted("zero2", lr=1e-3)
    # One file is gathered whole and written before save_model returns: the
    # future it gives back is done [Note: single-file arguments].
    future = booster.save_model(model, Path(root) / "single", use_async=True)
    assert future is not None
    assert future.done()
    assert (Path(root) / "single" / "model.safetensors").is_file()
    dist.barrier()


def test_async_single_file_is_written_at_once(tmp_path: Path) -> None:
    run_subtests(check_single_file, 2, {}, args=(str(tmp_path),), timeout=120)
