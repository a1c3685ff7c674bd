"""Issue 52, every disk error named: a disk that fills during a save ends
with one line per failed rank naming the file, what was writing it, and
the bytes free (and needed, where known), exit code 2; no temporary file
is left, the earlier checkpoint stays intact and loadable, and the next
run removes the unfinished ``step-N.partial``. Before, ``torch.save``'s
C++ stream lost the errno (``RuntimeError: basic_ios::clear: iostream
error``, exit code 1), a failed async save of step 4 was reported "in step
of step 6", and pc-export ended in a traceback leaving ``.tmp-PID`` files.

The disk is a small tmpfs (needs root); ``PC_TRAIN_FAULT=...,action=fill-disk``
fills it at a chosen step and phase, leaving ``free`` bytes: ``phase=step``
just before the save, ``phase=save`` once the save's files are written
(before its commit)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path

import fault_runs
import pytest

from pc_booster.checkpoint.checksum import verify_sidecar
from pc_comm.testing import small_tmpfs
from pc_train.checkpoint import load_trainer_state
from pc_train.train_config import TrainConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SETTINGS = ["--model", "gpt2-tiny", "--plugin", "ddp", "--eval-every", "0", "--no-tensorboard",
            "--no-progress", "--timeout", "10", "--steps", "6",
            "--checkpoint-every", "2"]  # fmt: skip
FIX = "free space there or pass --output-dir on a larger disk, then --resume."


def _tmpfs(path: Path, size: str) -> AbstractContextManager[Path]:
    """A small file system of its own at ``path`` (needs root)."""
    return small_tmpfs(path, f"size={size}")


def _train(out: Path, *argv: str, fault: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PC_TRAIN_FAULT": fault}
    command = [sys.executable, "-m", "pc_train.train", *SETTINGS, "--output-dir", str(out)]
    return fault_runs.run_command([*command, *argv], env)


def _config(out: Path, steps: int = 6) -> TrainConfig:
    """The settings of :data:`SETTINGS` (``steps``), as a resume checks them."""
    return TrainConfig(
        model="gpt2-tiny", plugin="ddp", eval_every=0, tensorboard=False, progress=False,
        timeout=10, steps=steps, checkpoint_every=2, output_dir=str(out),
    )  # fmt: skip


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" in p.name)


SIZE = r"[\d,.]+ (?:bytes|KiB|MiB)"  # bytes_text's words, as a regex


# name: (argv, fault, the failing save's step, the file and what wrote it
# (a regex), whether every rank names it, the bytes the write needs).
CASES: dict[str, tuple[list[str], str, int, str, bool, bool]] = {
    # The shards of the sharded save (DCP): every rank, its share's bytes.
    "sync-shards": ([], "step=2,phase=save,free=65536", 4,
                    r"model \(rank [01]'s share of the sharded save\)", True, True),
    # torch.save through atomic_write (the scheduler, rank 0 alone).
    "sync-torch-save": ([], "step=4,phase=step,free=0", 4, r"scheduler\.pt", False, False),
    # torch.save of each rank's RNG state.
    "sync-rng": ([], "step=4,phase=step,free=8192", 4,
                 r"rng-rank[01]\.pt \(rank [01]'s RNG state\)", True, False),
    # Written in the background; the error reaches training at step 6's
    # save, named as the save of step 4.
    "async-shards": (["--async-save"], "step=2,phase=save,free=65536", 4,
                     r"model \(rank [01]'s share of the sharded save\)", True, True),
    # The commit (rank 0): trainer_state.json.
    "sync-commit": ([], "step=4,phase=save,free=0", 4,
                    r"trainer_state\.json \(the commit of step-000004\)", True, False),
    "async-commit": (["--async-save"], "step=4,phase=save,free=0", 4,
                     r"trainer_state\.json \(the commit of step-000004\)", False, False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_full_disk_in_a_save_is_named_in_one_line(case: str, tmp_path: Path) -> None:
    argv, where, step, named, every_rank, needs = CASES[case]
    with _tmpfs(tmp_path / "disk", "20m") as disk:
        out = disk / "run"
        filler = disk / "filler"
        fault = f"rank=0,{where},action=fill-disk,path={filler}"
        done = _train(out, *argv, fault=fault)
        err = done.stderr
        assert done.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        partial = re.escape(f"{out}/checkpoints/step-{step:06d}.partial/")
        need = rf"; it needs {SIZE}" if needs else ""
        line = (
            rf"pc-train: error: rank [01] in save of step {step}: DiskWriteError: cannot write "
            rf"{partial}{named}: the disk is full \({SIZE} free of 20\.0 MiB there{need}\); "
            + re.escape(FIX)
        )
        found = [entry for entry in err.splitlines() if re.fullmatch(line, entry)]
        assert len(found) >= (2 if every_rank else 1), err[-3000:]
        assert _leftovers(out) == [], _leftovers(out)
        # The earlier checkpoint is whole (sizes, checksums, the model opens).
        earlier = out / "checkpoints" / "step-000002"
        load_trainer_state(earlier, _config(out), verify_contents=True)
        # With room again, the next run resumes from it and removes the
        # unfinished save first.
        filler.unlink()
        resumed = _train(out, "--resume", "--steps", "4")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"pc-train: removed step-{step:06d}.partial" in resumed.stdout, resumed.stdout
        assert not list((out / "checkpoints").glob("*.partial"))
        assert (out / "checkpoints" / "step-000004" / "trainer_state.json").is_file()


def test_pc_export_on_a_full_disk_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    """``pc-export CKPT OUT`` with OUT on a full disk: one line naming the
    file and the bytes free, exit code 2, nothing of the export left in
    OUT (neither temporary files nor shards no index names), CKPT intact."""
    source = tmp_path / "run"
    saved = _train(source, "--steps", "2")
    assert saved.returncode == 0, saved.stderr[-3000:]
    checkpoint = source / "checkpoints" / "step-000002"
    with _tmpfs(tmp_path / "disk", "300k") as disk:
        out = disk / "export"
        done = subprocess.run(
            [sys.executable, "-m", "pc_train.export", str(checkpoint), str(out),
             "--size-per-shard", "1"],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        err = done.stderr
        assert done.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        line = (
            rf"pc-export: error: cannot write {re.escape(str(out))}/model-\d{{5}}-of-\d{{5}}"
            rf"\.safetensors: the disk is full \({SIZE} free of 300\.0 KiB there\); free "
            r"space there or pass an OUT on a larger disk, then run pc-export again\."
        )
        assert re.fullmatch(line, err.strip()), err
        assert sorted(p.name for p in out.iterdir()) == [], list(out.iterdir())
    verify_sidecar(checkpoint / "model", collective=False)
    load_trainer_state(checkpoint, _config(source, steps=2), verify_contents=True)
