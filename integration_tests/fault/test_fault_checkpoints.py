"""Bad checkpoints, one test each: truncated, a corrupt trainer state, a
missing file, a file garbled at its full size, and a checkpoint of another
model. Each is refused with the reason: before any rank starts where the
launcher's checks can see it (exit code 2), else by every rank as it loads.
Nothing is deleted: the other checkpoints stay loadable."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import fault_runs
import pytest
import torch.distributed as dist

from pc_comm.testing import run_subtests
from pc_train.checkpoint import CheckpointError, load_trainer_state
from pc_train.train import main, train
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(300)

SETTINGS: dict[str, Any] = fault_runs.settings(4)
ARGV = fault_runs.argv(4)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with checkpoints at steps 2 and 4."""
    return fault_runs.saved_run(SETTINGS, tmp_path_factory)


def _copy(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out, out / "checkpoints" / "step-000004"


def _refused(out: Path, message: str, argv: list[str] = ARGV) -> None:
    """pc-train --resume stops before any rank starts, with ``message``."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main([*argv, "--output-dir", str(out), "--resume"])
    assert stop.value.code == 2, err.getvalue()
    assert message in err.getvalue(), err.getvalue()
    assert "Traceback" not in err.getvalue()


def _nothing_lost(out: Path) -> None:
    """The earlier checkpoint is untouched and passes every check; the bad
    one is left where it was, for the user to look at."""
    config = TrainConfig(**SETTINGS, output_dir=str(out))
    root = out / "checkpoints"
    assert load_trainer_state(root / "step-000002", config)["step"] == 2
    assert (root / "step-000004").is_dir()


def test_a_truncated_checkpoint_is_refused(saved_run: Path, tmp_path: Path) -> None:
    out, latest = _copy(saved_run, tmp_path)
    with open(latest / "model" / "__0_0.distcp", "r+b") as handle:
        handle.truncate(100)
    _refused(out, "is corrupt: model/__0_0.distcp has 100 bytes")
    _nothing_lost(out)


def test_a_corrupt_trainer_state_is_refused(saved_run: Path, tmp_path: Path) -> None:
    out, latest = _copy(saved_run, tmp_path)
    (latest / "trainer_state.json").write_text('{"step": 4, "files": ')
    _refused(out, "trainer_state.json is corrupt")
    _nothing_lost(out)


def test_a_checkpoint_missing_a_file_is_refused(saved_run: Path, tmp_path: Path) -> None:
    out, latest = _copy(saved_run, tmp_path)
    (latest / "scheduler.pt").unlink()
    _refused(out, "is incomplete: scheduler.pt is missing")
    _nothing_lost(out)


def test_a_checkpoint_of_another_model_is_refused(saved_run: Path, tmp_path: Path) -> None:
    out, _ = _copy(saved_run, tmp_path)
    other = [("llama-tiny" if arg == "gpt2-tiny" else arg) for arg in ARGV]
    _refused(out, "comes from a run with other settings (model: saved 'gpt2-tiny', now "
             "'llama-tiny')", other)  # fmt: skip
    _nothing_lost(out)


def _resume_fails_on_every_rank(out: str) -> None:
    config = TrainConfig(**SETTINGS, output_dir=out, resume="latest")
    with pytest.raises(CheckpointError, match=r"step-000004 does not load: .* is corrupt: "):
        train(config, fault_runs.context())
    dist.barrier()  # every rank got here: each raised the error itself


def test_a_checkpoint_garbled_at_its_full_size_fails_every_rank(
    saved_run: Path, tmp_path: Path
) -> None:
    """Without the launcher's checks (ranks started by torchrun, or train()
    itself): the Booster's loads verify the shards' checksums, each rank a
    part, and every rank raises."""
    out, latest = _copy(saved_run, tmp_path)
    optimizer = latest / "optimizer" / "__0_0.distcp"
    optimizer.write_bytes(os.urandom(optimizer.stat().st_size))  # sizes still match
    run_subtests(_resume_fails_on_every_rank, 2, {}, args=(str(out),), timeout=120)
    _nothing_lost(out)


def test_a_checkpoint_garbled_at_its_full_size_is_refused_before_any_rank_starts(
    saved_run: Path, tmp_path: Path
) -> None:
    """The launcher verifies every file's checksum (pc_booster.checkpoint.checksum)."""
    out, latest = _copy(saved_run, tmp_path)
    optimizer = latest / "optimizer" / "__0_0.distcp"
    optimizer.write_bytes(os.urandom(optimizer.stat().st_size))
    _refused(out, "is corrupt: optimizer/__0_0.distcp has checksum crc32:")
    _nothing_lost(out)
