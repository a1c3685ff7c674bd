"""What the checkpoint fault tests share: a short pc-train run on 2 gloo
ranks of the test harness, started in this process's own way (no
launcher), so a test can damage its checkpoints afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pc_comm import DistContext, DistEnv
from pc_comm.testing import run_subtests
from pc_train.train import train
from pc_train.train_config import TrainConfig


def settings(steps: int) -> dict[str, Any]:
    """A tiny ZeRO-2 run of ``steps`` steps, a checkpoint every 2."""
    return {
        "model": "gpt2-tiny", "plugin": "zero2", "steps": steps, "global_batch_size": 4,
        "seq_len": 16, "corpus_bytes": 20_000, "checkpoint_every": 2, "keep_last": 3,
        "eval_every": 0, "log_every": 2, "tensorboard": False, "progress": False,
    }  # fmt: skip


def argv(steps: int) -> list[str]:
    """The same run as pc-train's command line."""
    return ["--model", "gpt2-tiny", "--steps", str(steps), "--global-batch-size", "4",
            "--seq-len", "16", "--corpus-bytes", "20000", "--nproc", "2",
            "--plugin", "zero2"]  # fmt: skip


def context() -> DistContext:
    """This harness rank as pc-train's ``train()`` expects it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank, world, rank, world, node_rank=0, master_addr="127.0.0.1", master_port=0)
    return DistContext(env=env, backend="gloo", device=torch.device("cpu"))


def train_with(settings: dict[str, Any], out: str) -> None:
    train(TrainConfig(**settings, output_dir=out), context())


def saved_run(settings: dict[str, Any], factory: pytest.TempPathFactory) -> Path:
    """The output directory of a 2-rank run with ``settings``."""
    out = factory.mktemp("run")
    run_subtests(train_with, 2, {}, args=(settings, str(out)), timeout=240)
    return out


def run_command(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 200
) -> subprocess.CompletedProcess[str]:
    """``argv`` in a session of its own, its output captured; killed with
    everything it started if it outlives ``timeout``."""
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # hung: take what it started with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
