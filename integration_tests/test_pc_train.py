"""pc-train end to end, as a user runs it: the demo learns and ends with a
report and plots; a run interrupted by SIGINT, resumed, killed by SIGKILL
and resumed again repeats the uninterrupted loss curve bitwise; under
torchrun it runs unchanged; bad input ends with one clear message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pc_train.train import _start_method, main
from pc_train.train_config import parse_args

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# gpt2-small runs about 0.1 s a step here: slow enough to be killed mid-run.
RUN = ["--model", "gpt2-small", "--steps", "60", "--checkpoint-every", "10", "--log-every",
       "10", "--eval-every", "20", "--no-progress", "--nproc", "2"]  # fmt: skip
COMMAND = [sys.executable, "-m", "pc_train.train"]


def _losses(out: Path) -> list[float]:
    report = json.loads((out / "report.json").read_text())
    losses: list[float] = report["history"]["loss"]
    return losses


def _checkpoints(out: Path) -> list[int]:
    root = out / "checkpoints"
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if not p.name.endswith("partial"))


def _start_then_kill(out: Path, sig: int, after: int, *extra: str) -> int:
    """Start pc-train, send ``sig`` to its whole process group once a
    checkpoint past step ``after`` exists; returns the exit code."""
    proc = subprocess.Popen(
        [*COMMAND, *RUN, "--output-dir", str(out), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not any(step > after for step in _checkpoints(out)):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_demo_reports_and_resume_after_kills_repeats_the_curve(tmp_path: Path) -> None:
    before = _shm()
    try:
        _demo_and_resume(tmp_path)
    finally:
        # Ranks forked (a CPU-only torch): multiprocessing unlinks its
        # semaphores at once, so nothing can outlive even a SIGKILL of the
        # whole job. Spawned (a CUDA build): SIGKILL of the whole job kills
        # multiprocessing's resource tracker too, and the launcher's
        # semaphores (sem.mp-*) outlive it; pc's own segments never do.
        spawned = _start_method() != "fork"
        for name in _shm() - before:
            if spawned and name.startswith("sem.mp-"):
                os.unlink(os.path.join("/dev/shm", name))
        leaked = _shm() - before
        assert not leaked, leaked


def _demo_and_resume(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = subprocess.run(
        [*COMMAND, *RUN, "--output-dir", str(reference)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("report.json", "report.md", "loss.png", "throughput.png", "memory.png"):
        assert (reference / name).stat().st_size > 0, name
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    expected = _losses(reference)
    assert len(expected) == 60
    assert sum(expected[-10:]) / 10 < sum(expected[:10]) / 10 - 1.0, expected
    report = json.loads((reference / "report.json").read_text())
    states = report["model_states"]
    assert abs(states["predicted"] / states["measured"] - 1) < 0.1, states

    run = tmp_path / "interrupted"
    code = _start_then_kill(run, signal.SIGINT, 0)
    assert code == 130, code  # SIGINT: the ranks agree on a step, save it, exit
    first_stop = _checkpoints(run)[-1]
    assert first_stop < 60
    code = _start_then_kill(run, signal.SIGKILL, first_stop, "--resume")
    assert code == -signal.SIGKILL, code
    second_stop = _checkpoints(run)[-1]
    assert first_stop < second_stop < 60
    resumed = subprocess.run(
        [*COMMAND, *RUN, "--output-dir", str(run), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run) == expected  # bitwise: fp32, deterministic mode
    report = json.loads((run / "report.json").read_text())
    assert report["resumed_at"][-1] == second_stop
    assert len(_checkpoints(run)) <= 2  # keep-last 2


def test_runs_under_torchrun(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pc_train.train", "--model", "gpt2-tiny", "--steps", "4", "--plugin", "zero2",
         "--no-progress", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "with zero2 on 2 gloo rank(s)" in result.stdout
    assert len(_losses(tmp_path)) == 4


def test_one_rank_on_all_cores_after_plugin_auto(tmp_path: Path) -> None:
    """On a CPU-only torch the launcher forks its ranks. ``--plugin auto``
    measures the CPU in the launcher first; were that on several threads, a
    rank forked afterwards that runs on several threads (one rank: all the
    cores) would hang in GNU OpenMP."""
    proc = subprocess.Popen(
        [*COMMAND, "--model", "gpt2-tiny", "--steps", "2", "--nproc", "1", "--plugin", "auto",
         "--no-progress", "--no-tensorboard", "--eval-every", "0", "--output-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # hung: take the forked rank with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "with ddp on 1 gloo rank(s)" in out, out
    assert len(_losses(tmp_path)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt9"], "unknown model 'gpt9'"),
        (["--model", "/no/such/dir"], "does not exist"),
        (["--plugin", "hybrid", "--tp", "3"], "does not divide the world size (2)"),
        (["--plugin", "zero1", "--tp", "2"], "--tp hybrid, fsdp or gemini"),
        (
            ["--plugin", "auto", "--tp", "2"],
            "--plugin auto chooses the layout itself, and --tp 2 would be overwritten",
        ),
        (["--corpus", "/no/such/corpus.txt"], "corpus '/no/such/corpus.txt' does not exist"),
        (["--plugin", "zero2", "--global-batch-size", "3"], "does not split into 2 data-parallel"),
        (["--steps", "0"], "steps must be an integer of at least 1, got 0"),
        (["--resume"], "no checkpoint in"),
        (["--plugin", "zero1", "--step-in-backward"], "an option of --plugin gemini"),
        (
            ["--plugin", "gemini", "--step-in-backward"],
            "max_norm=1.0 cannot clip by the global norm; pass max_norm=0",
        ),
        (
            ["--plugin", "auto", "--step-in-backward", "--precision", "fp16", "--clip-norm", "0"],
            "fp16 overflow could not skip the step",
        ),
        (
            ["--plugin", "gemini", "--step-in-backward", "--clip-norm", "0", "--accumulation", "2"],
            "gradients cannot accumulate over 2 micro-batches",
        ),
        (
            ["--plugin", "gemini", "--step-in-backward", "--clip-norm", "0", "--precision", "fp16"],
            "use bf16 or fp32, or step_in_backward=False",
        ),
        (
            ["--plugin", "fsdp", "--optimizer-states", "bf16"],
            "built for --plugin zero1 / zero2 / gemini so far, not fsdp",
        ),
        (
            ["--plugin", "auto", "--optimizer-states", "int8"],
            "--optimizer-states int8 would be overwritten",
        ),
        (
            ["--plugin", "fsdp", "--nvme-offload-fraction", "1"],
            "or gemini (--offload-frac), not fsdp",
        ),
        (
            ["--plugin", "zero2", "--nvme-offload-fraction", "0.5"],
            "pass cpu_offload=True with it, or nvme_offload_fraction=0. (in pc-train: "
            "cpu_offload is --cpu-offload, nvme_offload_fraction is --nvme-offload-fraction)",
        ),
        (
            ["--plugin", "auto", "--nvme-offload-fraction", "0.5"],
            "--nvme-offload-fraction 0.5 would be overwritten",
        ),
        (
            ["--nvme-offload-fraction", "2"],
            "nvme_offload_fraction must be a share in [0, 1], got 2.0",
        ),
    ],
)
def test_bad_input_is_one_clear_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--output-dir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_yaml_config_with_command_line_overrides(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("model: llama-tiny\nsteps: 30\nglobal-batch-size: 8\nlr: 1\n")
    parsed = parse_args(["--config", str(config), "--steps", "12"])
    assert (parsed.model, parsed.steps, parsed.global_batch_size, parsed.lr) == (
        "llama-tiny", 12, 8, 1.0,
    )  # fmt: skip
    config.write_text("modle: gpt2-tiny\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    config.write_text("steps: many\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])


def test_moments_on_disk_train_as_in_memory_and_leave_nothing(tmp_path: Path) -> None:
    """``--nvme-offload-fraction 1`` (ZeRO-2 with CPU offload): the same
    losses, bitwise, as the moments in memory; the scratch directory pc
    made inside ``--nvme-offload-dir`` is gone when the run ends."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    runs: list[list[float]] = []
    for extra in ([], ["--nvme-offload-fraction", "1", "--nvme-offload-dir", str(scratch)]):
        out = tmp_path / f"run{len(runs)}"
        done = subprocess.run(
            [*COMMAND, "--model", "gpt2-tiny", "--plugin", "zero2", "--cpu-offload", "--nproc",
             "2", "--steps", "4", "--no-progress", "--no-tensorboard", "--eval-every", "0",
             "--log-every", "1", "--checkpoint-every", "0", "--output-dir", str(out), *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(_losses(out))
    assert len(runs[0]) == 4
    assert runs[0] == runs[1], runs
    assert list(scratch.iterdir()) == []


def test_optimizer_states_narrow_train_and_resume_in_another_format(tmp_path: Path) -> None:
    """ZeRO-2 with 8-bit moments trains and checkpoints; the run resumes
    from its step-4 checkpoint with bf16 moments (fp32 moments inside)."""
    base = ["--model", "gpt2-tiny", "--plugin", "zero2", "--nproc", "2", "--no-progress",
            "--no-tensorboard", "--eval-every", "0", "--checkpoint-every", "2",
            "--output-dir", str(tmp_path)]  # fmt: skip
    older = str(tmp_path / "checkpoints" / "step-000004")
    for extra in (["--steps", "6", "--optimizer-states", "int8"],
                  ["--steps", "6", "--optimizer-states", "bf16", "--resume", older]):  # fmt: skip
        done = subprocess.run(
            [*COMMAND, *base, *extra], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == 6
    assert all(loss == loss for loss in losses)  # finite, not NaN


def test_auto_resume_keeps_the_saved_runs_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--plugin auto --resume`` takes the layout of the run it resumes,
    without planning again: the planner's choice rests on a measured peak
    and may tip another way on a later start, and another layout would not
    repeat the curve bitwise (the demo test failed that way once the
    planner offered more pipeline schedules)."""
    from pc_train import plan
    from pc_train.train import prepare

    base = ["--model", "gpt2-tiny", "--nproc", "2", "--no-progress", "--no-tensorboard",
            "--eval-every", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [*COMMAND, *base, "--plugin", "zero1", "--cpu-offload", "--steps", "4",
         "--checkpoint-every", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned again on resume")

    monkeypatch.setattr(plan, "_choose_plugin", no_planning)
    older = str(tmp_path / "checkpoints" / "step-000002")
    config, _, reasons = prepare(parse_args([*base, "--plugin", "auto", "--resume", older,
                                             "--steps", "4"]), 2)  # fmt: skip
    assert (config.plugin, config.cpu_offload) == ("zero1", True), config
    assert "the layout the saved run trained with (zero1 cpu-offload" in reasons[0], reasons
    with pytest.raises(ValueError, match="--tp 2 would be overwritten"):
        prepare(parse_args([*base, "--plugin", "auto", "--resume", older, "--tp", "2"]), 2)
