"""Resume exactness for every plugin: pc-train's own loop (``train``), run
in one spawned group, saves at step 2 of 4; a second run resumes from that
checkpoint, and its losses for steps 3 and 4
equal the uninterrupted run's bitwise (fp32, deterministic kernels)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pc_booster.train import train
from pc_booster.train_config import TrainConfig
from pc_comm import DistContext, DistEnv
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(600)

PLUGINS: dict[str, dict[str, object]] = {
    "ddp": {"plugin": "ddp"},
    "fsdp": {"plugin": "fsdp"},
    "zero1": {"plugin": "zero1"},
    "zero2": {"plugin": "zero2"},
    "gemini": {"plugin": "gemini"},
    "hybrid-tp2": {"plugin": "hybrid", "tp": 2},
    "hybrid-pp2": {"plugin": "hybrid", "pp": 2, "clip_norm": 0.0},
}


def _context() -> DistContext:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank, world, rank, world, node_rank=0, master_addr="127.0.0.1", master_port=0)
    return DistContext(env=env, backend="gloo", device=torch.device("cpu"))


def _resume_case(root: str, plugin: str) -> None:
    torch.use_deterministic_algorithms(True)
    out = str(Path(root) / plugin)
    config = TrainConfig(
        model="gpt2-tiny", steps=4, global_batch_size=4, seq_len=16, corpus_bytes=20_000,
        checkpoint_every=2, keep_last=3, eval_every=0, log_every=2, tensorboard=False,
        progress=False, output_dir=out, **PLUGINS[plugin],  # type: ignore[arg-type]
    )  # fmt: skip
    expected = train(config, _context())["loss"]
    saved = Path(out) / "checkpoints" / "step-000002"
    # A load that missed anything would train on from step 0's weights.
    resumed = train(TrainConfig(**{**config.to_dict(), "resume": str(saved)}), _context())
    assert len(expected) == 4
    assert resumed["loss"] == expected, (plugin, resumed["loss"], expected)


def test_resume_repeats_the_loss_curve_bitwise_for_every_plugin(tmp_path: Path) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_subtests(_resume_case, 2, {"plugin": list(PLUGINS)}, args=(str(tmp_path),), timeout=540)
