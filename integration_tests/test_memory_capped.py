"""No rank ever holds the whole model, checked by the kernel: every rank of
a 4-rank job runs under a memory cap (a cgroup v1 memory group per rank,
:mod:`memory_cap`) of its plugin's share of the model states plus a stated
margin, on a GPT-2 (16 blocks of width 512, 50.5 M parameters) whose fp32
parameters and Adam moments (606 MB) exceed every cap. Under Gemini,
LowLevelZero stage 2, TorchFSDP and HybridParallel tp 2 the model is built
lazily, trains 3 steps and is saved sharded; the job ends; a 2-rank job
under another plugin, capped at its own share, loads it and trains on with
the losses of the uninterrupted run (rtol 1e-5), and a 4-rank job under
the same plugin repeats them bitwise (deterministic fp32). The same again
through pc-train's command line (``PC_TRAIN_CGROUP``).

A rank over its cap is killed by the kernel's OOM killer: the harness then
reports it (killed by SIGKILL) and the test names the cap it went over.
Host memory is measured as the kernel charges it, so the ranks ask glibc to
give large freed blocks back (``HostAllocatorSettings(mmap_threshold=1 MiB)``)
rather than keep the peak heap (pc-comm's [Note: host allocator]).
Run by ``nox -s scale`` (a few minutes), not by ``nox -s tests``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from memory_cap import MemoryCap, unavailable
from transformers import GPT2Config, GPT2LMHeadModel

from pc_booster import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchFSDPPlugin,
    TrainPrecision,
)
from pc_chunk import LazyInitContext
from pc_comm import tune_host_allocator
from pc_comm.host_allocator import HostAllocatorSettings
from pc_comm.testing import spawn

pytestmark = [
    pytest.mark.scale,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(unavailable() is not None, reason=f"memory caps: {unavailable()}"),
]

WIDTH, LAYERS = 512, 16
GLOBAL_BATCH, SEQ, LR = 4, 16, 1e-4
SAVED_AT, STEPS = 3, 5
MIB = 2**20
# Over each rank's share of the model states: activations, gathered chunks
# or layers, communication buffers, Python's own allocations after joining.
MARGIN = 224 * MIB
# Small Gemini chunks (1-3 M elements), as a large model has them relative
# to its size.
PLUGINS: dict[str, Callable[[], Plugin]] = {
    "gemini": lambda: GeminiPlugin(search_range_m=2, min_chunk_size_m=1),
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-fsdp": TorchFSDPPlugin,
    "hybrid-tp2": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1),
    # At 2 ranks a ZeRO-3 share is already 2/3 of the whole model states;
    # stepping in backward keeps 12 bytes per parameter instead of 16, so
    # the share and the margin stay under the whole.
    "gemini-step-in-backward": lambda: GeminiPlugin(
        search_range_m=2, min_chunk_size_m=1, step_in_backward=True
    ),
}
# Every plugin's checkpoint of 4 ranks is resumed at 2 under this one.
RESUME_AT_2 = "gemini-step-in-backward"


def _config() -> GPT2Config:
    return GPT2Config(
        vocab_size=256, n_positions=32, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def _psi() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT2LMHeadModel(_config()).parameters())


def cap_bytes(plugin: str, world: int) -> int:
    """The plugin's own memory model of its model states per rank (fp32,
    Adam), plus MARGIN."""
    options = PLUGINS[plugin]().options
    tp = 2 if plugin == "hybrid-tp2" else 1  # the memory model counts a rank's model part
    states = options.model_states(_psi() / tp, world // tp, TrainPrecision.FP32)
    return int(states.total) + MARGIN


def full_state_bytes() -> int:
    """fp32 parameters and Adam's two moments of the whole model."""
    return 12 * _psi()


def _capped(name: str, limit: int) -> MemoryCap:
    """This rank's cap, joined after its imports and process group."""
    assert tune_host_allocator(
        HostAllocatorSettings(mmap_threshold=1 * MIB, trim_threshold=1 * MIB, top_pad=0)
    )
    cap = MemoryCap(f"{name}-rank{dist.get_rank()}", limit)
    cap.join()
    return cap


def _batch(step: int, booster: Booster) -> dict[str, torch.Tensor]:
    group = booster.plugin.dp_group
    rank, dp = dist.get_rank(group), dist.get_world_size(group)
    ids = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // dp
    mine = ids[rank * per : (rank + 1) * per]
    return {"input_ids": mine, "labels": mine}


def _train(booster: Booster, model: Any, optimizer: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(**_batch(step, booster)).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        group = booster.plugin.dp_group
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / dist.get_world_size(group))
    return losses


def _boosted(plugin: str) -> tuple[Booster, Any, Any]:
    booster = Booster(plugin=PLUGINS[plugin]())
    torch.manual_seed(0)
    with LazyInitContext():
        model = GPT2LMHeadModel(_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def _record(root: str, name: str, value: Any) -> None:
    if dist.get_rank() == 0:
        (Path(root) / f"{name}.json").write_text(json.dumps(value))


def _peaks(cap: MemoryCap, anonymous: Callable[[], int]) -> list[list[int]]:
    """Every rank's (peak usage, peak anonymous memory)."""
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, [cap.peak(), anonymous()])
    return peaks


def save_run(root: str, plugin: str) -> None:
    """4 ranks: build lazily, train 3 steps, save, then train on (the
    uninterrupted run's losses)."""
    torch.use_deterministic_algorithms(True)
    cap = _capped(f"pc-cap-{plugin}-save", cap_bytes(plugin, 4))
    anonymous = cap.sample_anonymous()
    booster, model, optimizer = _boosted(plugin)
    losses = _train(booster, model, optimizer, range(SAVED_AT))
    out = Path(root) / plugin
    booster.save_model(model, out / "model", shard=True)
    booster.save_optimizer(optimizer, out / "optimizer", shard=True)
    losses += _train(booster, model, optimizer, range(SAVED_AT, STEPS))
    _record(root, f"{plugin}-uninterrupted", {"losses": losses, "peaks": _peaks(cap, anonymous)})


def resume_run(root: str, saved: str, plugin: str, label: str) -> None:
    """Load what ``saved`` wrote under ``plugin`` (at this world size) and
    train on."""
    torch.use_deterministic_algorithms(True)
    cap = _capped(f"pc-cap-{label}", cap_bytes(plugin, dist.get_world_size()))
    anonymous = cap.sample_anonymous()
    booster, model, optimizer = _boosted(plugin)
    booster.load_model(model, Path(root) / saved / "model")
    booster.load_optimizer(optimizer, Path(root) / saved / "optimizer")
    losses = _train(booster, model, optimizer, range(SAVED_AT, STEPS))
    _record(root, label, {"losses": losses, "peaks": _peaks(cap, anonymous)})


def _run(fn: Callable[..., None], world: int, args: tuple[Any, ...], caps: list[str]) -> None:
    try:
        spawn(fn, world, args=args, timeout=600, name=f"{fn.__name__}{args[1:]}")
    except Exception as error:
        raise AssertionError(f"{fn.__name__}{args[1:]} failed under its caps; {error}") from None
    finally:
        for name in caps:
            for rank in range(world):
                MemoryCap.remove_group(f"{name}-rank{rank}")


@pytest.mark.parametrize("plugin", [p for p in PLUGINS if p != RESUME_AT_2])
def test_no_rank_holds_the_whole_model(plugin: str, tmp_path: Path) -> None:
    full = full_state_bytes()
    for world, target in ((4, plugin), (2, RESUME_AT_2)):
        assert cap_bytes(target, world) < full, (target, world, cap_bytes(target, world), full)
    root = str(tmp_path)
    _run(save_run, 4, (root, plugin), [f"pc-cap-{plugin}-save"])
    other = RESUME_AT_2
    _run(resume_run, 2, (root, plugin, other, "resumed-at-2"), ["pc-cap-resumed-at-2"])
    _run(resume_run, 4, (root, plugin, plugin, "resumed-at-4"), ["pc-cap-resumed-at-4"])
    uninterrupted = json.loads((tmp_path / f"{plugin}-uninterrupted.json").read_text())
    at_2 = json.loads((tmp_path / "resumed-at-2.json").read_text())
    at_4 = json.loads((tmp_path / "resumed-at-4.json").read_text())
    expected = uninterrupted["losses"][SAVED_AT:]
    torch.testing.assert_close(torch.tensor(at_2["losses"]), torch.tensor(expected),
                               rtol=1e-5, atol=0.0)  # fmt: skip
    assert at_4["losses"] == expected, (at_4["losses"], expected)
    for name, record, world, target in (
        ("save", uninterrupted, 4, plugin),
        ("resume at 2", at_2, 2, other),
        ("resume at 4", at_4, 4, plugin),
    ):
        usage = max(p[0] for p in record["peaks"]) / MIB
        anonymous = max(p[1] for p in record["peaks"]) / MIB
        print(f"{plugin} {name} ({target} at {world}): peak {anonymous:.0f} MiB anonymous, "
              f"{usage:.0f} MiB with page cache, of a {cap_bytes(target, world) / MIB:.0f} MiB "
              f"cap; whole model states {full / MIB:.0f} MiB")  # fmt: skip


def test_pc_train_under_memory_caps(tmp_path: Path) -> None:
    """pc-train's command line: 4 ranks under zero2 with a checkpoint at step
    3, the job killed at step 4 (PC_TRAIN_FAULT), then --resume at 2 ranks
    under gemini --step-in-backward for steps 4 and 5, each rank capped at
    its plugin's share (PC_TRAIN_CGROUP); the resumed losses match an
    uninterrupted capped run's."""
    full = full_state_bytes()
    model = tmp_path / "config.json"
    model.write_text(_config().to_json_string())
    base = [sys.executable, "-m", "pc_train.train", "--model", str(model), "--global-batch-size",
            str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--corpus-bytes", "40000", "--eval-every",
            "0", "--no-progress", "--no-tensorboard", "--clip-norm", "0", "--lr", str(LR),
            "--warmup", "0"]  # fmt: skip

    def run(
        out: Path, plugin: str, nproc: int, steps: int, *extra: str, kill: str = ""
    ) -> dict[str, Any]:
        in_backward = "--step-in-backward" in extra
        limit = cap_bytes("gemini-step-in-backward" if in_backward else plugin, nproc)
        assert limit < full
        prefix = f"pc-cap-cli-{plugin}-{nproc}"
        caps = [MemoryCap(f"{prefix}-rank{r}", limit) for r in range(nproc)]
        env = {**os.environ, "PC_TRAIN_CGROUP": prefix, "PC_TRAIN_FAULT": kill}
        command = [*base, "--plugin", plugin, "--nproc", str(nproc), "--steps", str(steps),
                   "--output-dir", str(out), *extra]  # fmt: skip
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        finally:
            kills = [cap.oom_kills() for cap in caps]
            for cap in caps:
                cap.remove()
        assert not any(kills), f"the kernel killed a rank over its cap: {kills}"
        if kill:  # the job was killed after its checkpoint
            assert done.returncode == 1, done.stderr[-3000:]
            assert "failed first (killed by SIGKILL)" in done.stderr, done.stderr[-3000:]
            return {}
        assert done.returncode == 0, done.stderr[-3000:]
        report: dict[str, Any] = json.loads((out / "report.json").read_text())
        return report

    whole = run(tmp_path / "whole", "zero2", 4, STEPS, "--checkpoint-every", str(SAVED_AT))
    # The same run, killed (SIGKILL, rank 1) as step 4 starts: its checkpoint
    # of step 3 is complete.
    kill = f"rank=1,step={SAVED_AT + 1},phase=forward,action=kill"
    run(tmp_path / "part", "zero2", 4, STEPS, "--checkpoint-every", str(SAVED_AT), kill=kill)
    resumed = run(tmp_path / "part", "gemini", 2, STEPS, "--resume", "--checkpoint-every", "0",
                  "--step-in-backward")  # fmt: skip
    expected = whole["history"]["loss"][SAVED_AT:]
    got = resumed["history"]["loss"][SAVED_AT:]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0.0)
