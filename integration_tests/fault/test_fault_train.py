"""pc-train's failures named in one line each, as a user runs it: an
exception pc-train does not expect reaches the terminal with its type,
message, rank and phase (the traceback in a file), exit code 1; a disk that
fills during a save is named with its path, exit code 2; what can be
checked before any rank starts (a full or read-only --output-dir, a short
corpus, a plan's splits, numbers that are not finite) is refused there, in
one line, exit code 2. A run resumed at a larger world size trains to its
end and writes its report; one resumed with more --steps keeps the saved
learning-rate schedule."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import fault_runs
import pytest

from pc_comm.testing import small_tmpfs
from pc_train.train import main

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BASE = ["--model", "gpt2-tiny", "--plugin", "ddp", "--eval-every", "0", "--no-tensorboard",
        "--no-progress", "--timeout", "10"]  # fmt: skip
COMMAND = [sys.executable, "-m", "pc_train.train", *BASE]


def _run(*argv: str, fault: str = "") -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PC_TRAIN_FAULT": fault}
    start = time.monotonic()
    done = fault_runs.run_command([*COMMAND, *argv], env)
    return done, time.monotonic() - start


_tmpfs = small_tmpfs


def test_an_unexpected_exception_reaches_the_user_in_one_line(tmp_path: Path) -> None:
    done, elapsed = _run(
        "--steps", "4", "--output-dir", str(tmp_path),
        fault="rank=1,step=2,phase=forward,action=raise",
    )  # fmt: skip
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    log = tmp_path / "logs" / "rank1-error.log"
    line = (
        "pc-train: error: rank 1 in forward of step 2: InjectedFaultError: PC_TRAIN_FAULT: "
        f"injected on rank 1 in forward of step 2 (traceback: {log})"
    )
    assert line in err.splitlines(), err[-3000:]
    assert "Traceback (most recent call last)" in log.read_text()
    assert elapsed < 60, elapsed


def test_a_disk_full_in_a_save_is_named_with_its_path(tmp_path: Path) -> None:
    # Room for the two checkpoints the preflight asks for (16 bytes per
    # parameter each, 1.9 MB) but not for a third (they take 1.7 MB).
    with _tmpfs(tmp_path / "disk", "size=4500k") as disk:
        out = disk / "run"
        done, elapsed = _run(
            "--steps", "6", "--checkpoint-every", "1", "--keep-last", "6", "--output-dir",
            str(out),
        )  # fmt: skip
        err = done.stderr
        assert done.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert "its process is gone" not in err, err[-3000:]
        # torch's writers say it as an OSError (ENOSPC) or a short write;
        # either is named with the file (fault/test_fault_disk_full.py).
        assert "in save of step 3: DiskWriteError: cannot write " in err, err[-3000:]
        assert f"{out}/checkpoints/step-000003.partial/" in err, err[-3000:]
        assert ": the disk is full (" in err, err[-3000:]
        assert "free space there or pass --output-dir on a larger disk" in err, err[-3000:]
        assert (out / "checkpoints" / "step-000002").is_dir()
        assert elapsed < 60, elapsed


def _model_of_32_positions(tmp_path: Path) -> str:
    from pc_train.models import resolve_model

    config = resolve_model("gpt2-tiny", 32).config.to_dict()
    config["n_positions"] = 32
    path = tmp_path / "short.json"
    path.write_text(json.dumps(config))
    return str(path)


# name: (extra argv, text the one line holds); argv may name {tmp}.
PREFLIGHT: dict[str, tuple[list[str], str]] = {
    "clip-norm-nan": (["--clip-norm", "nan"], "clip_norm must be a finite global norm >= 0"),
    "timeout-inf": (["--timeout", "inf"], "timeout must be a number of seconds > 0"),
    "timeout-nan": (["--timeout", "nan"], "timeout must be a number of seconds > 0"),
    "lr-inf": (["--lr", "inf"], "lr must be positive and finite, got inf"),
    "lr-nan": (["--lr", "nan"], "lr must be positive and finite, got nan"),
    "weight-decay-nan": (["--weight-decay", "nan"], "weight_decay must be finite and >= 0"),
    "short-corpus": (
        ["--corpus", "{tmp}/tiny.txt"],
        "the corpus holds 100 byte(s); --seq-len 64 needs at least 1,320",
    ),
    "microbatches": (
        ["--plugin", "hybrid", "--pp", "2", "--clip-norm", "0", "--microbatches", "3"],
        "--microbatches 3 does not divide the 16 sequence(s) each pipeline takes per step",
    ),
    "sequence-split": (
        ["--plugin", "hybrid", "--sp", "2", "--seq-len", "63"],
        "--seq-len 63 does not split into 2 equal blocks",
    ),
    "max-positions": (["--model", "{short}"], "is longer than model"),
}


@pytest.mark.parametrize("case", list(PREFLIGHT))
def test_preflight_refuses_in_one_line_before_any_rank_starts(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = PREFLIGHT[case]
    (tmp_path / "tiny.txt").write_bytes(b"x" * 100)
    short = _model_of_32_positions(tmp_path) if case == "max-positions" else ""
    argv = [a.format(tmp=tmp_path, short=short) for a in argv]
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        main([*BASE, "--steps", "2", "--output-dir", str(tmp_path / "run"), *argv])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured.err
    assert message in captured.err, captured.err
    assert "Traceback" not in captured.err
    assert "starting" not in captured.out, captured.out  # no rank started
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_preflight_names_a_full_or_read_only_output_dir(
    disk: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = "size=1M" if disk == "full" else "size=1M,ro"
    with _tmpfs(tmp_path / "disk", options) as mount:
        out = mount if disk == "read-only" else mount / "run"
        with pytest.raises(SystemExit) as stop:
            main([*BASE, "--steps", "2", "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured.err
    assert "starting" not in captured.out, captured.out
    if disk == "full":
        expected = (
            f"pc-train: error: --output-dir {out} has 1.0 MiB (1,048,576 bytes) free; two "
            "checkpoints of gpt2-tiny need 3.7 MiB (3,858,432 bytes: 16 per parameter each); "
            "free space there or pass --output-dir on a larger disk."
        )
    else:
        expected = (
            f"pc-train: error: --output-dir {out} must be writable, but writing "
            f".pc-train-probe-{os.getpid()} there failed: read-only file system; pass a "
            "writable --output-dir."
        )
    assert captured.err.strip() == expected, captured.err


def _report(out: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads((out / "report.json").read_text())
    return report


def test_a_run_resumed_at_a_larger_world_size_ends_with_its_report(tmp_path: Path) -> None:
    first, _ = _run(
        "--steps", "4", "--checkpoint-every", "2", "--log-every", "1", "--output-dir",
        str(tmp_path), fault="rank=1,step=3,phase=forward,action=kill",
    )  # fmt: skip
    assert first.returncode == 1, first.stderr[-3000:]
    resumed, _ = _run(
        "--steps", "4", "--checkpoint-every", "2", "--log-every", "1", "--output-dir",
        str(tmp_path), "--resume", "--nproc", "4",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    report = _report(tmp_path)
    assert report["world"] == 4
    assert report["resumed_at"] == [2]
    history = report["history"]
    assert isinstance(history, dict)
    assert history["step"] == [1, 2, 3, 4]
    assert [len(e["peak_memory"]) for e in history["log"]] == [2, 2, 4, 4]
    assert (tmp_path / "report.md").is_file()
    assert (tmp_path / "checkpoints" / "step-000004").is_dir()


def _lr_rule(lr: float, warmup: int, total: int, step: int) -> float:
    warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
    return lr * warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


def test_more_steps_on_resume_are_refused_or_extend_the_schedule(tmp_path: Path) -> None:
    """Issue 44: --steps past the saved schedule trained on at learning rate
    0; it is refused, naming both ways forward, and --extend-schedule
    stretches the cosine to the new length (the steps before as they were)."""
    lr, warmup = 0.01, 2
    shared = ["--lr", str(lr), "--warmup", str(warmup), "--log-every", "1"]
    first, _ = _run("--steps", "4", "--checkpoint-every", "2", "--output-dir",
                    str(tmp_path / "first"), *shared)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    saved = tmp_path / "first" / "checkpoints" / "step-000002"
    refused, _ = _run("--steps", "6", "--output-dir", str(tmp_path / "refused"), "--resume",
                      str(saved), *shared)  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "--steps 6 goes past the learning-rate schedule" in refused.stderr
    assert "--extend-schedule" in refused.stderr
    assert "pc-export" in refused.stderr
    longer, _ = _run("--steps", "6", "--output-dir", str(tmp_path / "longer"), "--resume",
                     str(saved), "--extend-schedule", *shared)  # fmt: skip
    assert longer.returncode == 0, longer.stderr[-3000:]
    logged = {e["step"]: e["lr"] for e in _report(tmp_path / "longer")["history"]["log"]}  # type: ignore[index]
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    before = {e["step"]: e["lr"] for e in _report(tmp_path / "first")["history"]["log"]}  # type: ignore[index]
    assert [logged[s] for s in (1, 2)] == [before[s] for s in (1, 2)]
    for step in (3, 4, 5, 6):  # the cosine over the new length
        assert logged[step] == pytest.approx(_lr_rule(lr, warmup, 6, step), abs=1e-12), logged
    assert logged[5] > 0  # learning after the old end (step 4), to 0 at the new one
