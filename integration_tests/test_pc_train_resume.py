"""pc-train's own loop (``train``), run in one spawned group. Resume
exactness for every plugin: a run saves at step 2 of 4; a second run
resumes from that checkpoint, and its losses for steps 3 and 4 equal the
uninterrupted run's bitwise (fp32, deterministic kernels). And a run that
diverges stops on every rank before the optimizer step, naming the step
and the ranks."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pc_comm import DistContext, DistEnv
from pc_comm.testing import run_subtests, spawn
from pc_train.train import NonFiniteLossError, train
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(600)

PLUGINS: dict[str, dict[str, object]] = {
    "ddp": {"plugin": "ddp"},
    "fsdp": {"plugin": "fsdp"},
    "zero1": {"plugin": "zero1"},
    "zero2": {"plugin": "zero2"},
    "gemini": {"plugin": "gemini"},
    "gemini-step-in-backward": {"plugin": "gemini", "step_in_backward": True, "clip_norm": 0.0},
    "hybrid-tp2": {"plugin": "hybrid", "tp": 2},
    "hybrid-pp2": {"plugin": "hybrid", "pp": 2, "clip_norm": 0.0},
    # Checkpoints written in the background while training goes on.
    "zero2-async": {"plugin": "zero2", "async_save": True},
    "hybrid-tp2-async": {"plugin": "hybrid", "tp": 2, "zero_stage": 1, "async_save": True},
    # Mixture of experts, its experts split over both ranks (expert parallelism 2).
    "hybrid-ep2": {
        "model": "mixtral-tiny",
        "plugin": "hybrid",
        "ep": 2,
        "zero_stage": 1,
        "clip_norm": 0.0,
    },
}


def _context() -> DistContext:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank, world, rank, world, node_rank=0, master_addr="127.0.0.1", master_port=0)
    return DistContext(env=env, backend="gloo", device=torch.device("cpu"))


def _resume_case(root: str, plugin: str) -> None:
    torch.use_deterministic_algorithms(True)
    out = str(Path(root) / plugin)
    settings: dict[str, Any] = {
        "model": "gpt2-tiny", "steps": 4, "global_batch_size": 4, "seq_len": 16,
        "corpus_bytes": 20_000, "checkpoint_every": 2, "keep_last": 3, "eval_every": 0,
        "log_every": 2, "tensorboard": False, "progress": False, "output_dir": out,
    }  # fmt: skip
    config = TrainConfig(**{**settings, **PLUGINS[plugin]})
    expected = train(config, _context())["loss"]
    saved = Path(out) / "checkpoints" / "step-000002"
    # A load that missed anything would train on from step 0's weights.
    resumed = train(TrainConfig(**{**config.to_dict(), "resume": str(saved)}), _context())
    assert len(expected) == 4
    assert resumed["loss"] == expected, (plugin, resumed["loss"], expected)


def _in_backward_case(root: str) -> None:
    """--step-in-backward trains exactly as Gemini stepping after backward."""
    torch.use_deterministic_algorithms(True)
    losses = []
    for in_backward in (False, True):
        config = TrainConfig(
            model="gpt2-tiny", steps=4, global_batch_size=4, seq_len=16, corpus_bytes=20_000,
            checkpoint_every=0, eval_every=0, log_every=2, tensorboard=False, progress=False,
            output_dir=str(Path(root) / f"in-backward-{in_backward}"), plugin="gemini",
            clip_norm=0.0, step_in_backward=in_backward,
        )  # fmt: skip
        losses.append(train(config, _context())["loss"])
    assert len(losses[0]) == 4
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_step_in_backward_trains_as_stepping_after_backward(tmp_path: Path) -> None:
    spawn(_in_backward_case, 2, args=(str(tmp_path),), timeout=300)


def test_resume_repeats_the_loss_curve_bitwise_for_every_plugin(tmp_path: Path) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_subtests(_resume_case, 2, {"plugin": list(PLUGINS)}, args=(str(tmp_path),), timeout=540)


def _diverging_case(root: str, plugin: str) -> None:
    config = TrainConfig(
        model="gpt2-tiny", steps=20, global_batch_size=4, seq_len=16, corpus_bytes=20_000,
        lr=1e9, warmup=0, checkpoint_every=1, eval_every=0, tensorboard=False, progress=False,
        output_dir=str(Path(root) / f"diverge-{plugin}"), plugin=plugin,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError) as failure:
        train(config, _context())
    message = str(failure.value)
    match = re.match(
        r"step (\d+): the loss \(or gradient norm\) is not finite on rank\(s\) 0, 1; stopped "
        r"before the optimizer step \(--check-finite\), the last checkpoint is at step (\d+)\.",
        message,
    )
    assert match, message
    failed, saved = int(match.group(1)), int(match.group(2))
    assert saved == failed - 1  # the parameters of the bad step were never written
    assert not (Path(config.output_dir) / "checkpoints" / f"step-{failed:06d}").exists()


def test_a_diverging_run_stops_on_every_rank_naming_the_step(tmp_path: Path) -> None:
    run_subtests(
        _diverging_case, 2, {"plugin": ["ddp", "zero2"]}, args=(str(tmp_path),), timeout=240
    )
