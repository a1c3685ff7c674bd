"""Issue 52, replayed checkpoints ([Note: what a signature binds] in
``pc_train.signing``): with ``PC_CHECKPOINT_KEY`` set, a checkpoint's
signed state binds its step to its directory's name and its run to the
run of the directory it lies in, and each directory keeps a signed
high-water mark. An older, genuinely signed checkpoint copied over the
newest, renamed, or copied to a higher step number is refused; so is a
rollback by deleting the newer ones, one of another run, and a missing or
edited mark; ``--resume PATH`` still loads an older checkpoint when the
user names it. A key shorter than 32 bytes is refused with the way to
make one."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))  # the fault tests' short runs
import fault_runs
import pytest
from signing_env import key_env

from pc_comm.testing import run_subtests
from pc_train.checkpoint import CheckpointError, find_checkpoint, load_trainer_state
from pc_train.signing import HIGH_WATER, KEY_ENV, SIGNATURE, HighWater, sign, write_high_water
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(300)

KEY = "5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b"
SETTINGS = fault_runs.settings(4)  # checkpoints at steps 2 and 4


def _signed_run(out: str, resume: str | None = None) -> None:
    os.environ[KEY_ENV] = KEY
    try:
        settings = SETTINGS if resume is None else {**SETTINGS, "resume": resume}
        fault_runs.train_with(settings, out)
    finally:
        del os.environ[KEY_ENV]


def _refused(out: str) -> None:
    with pytest.raises(CheckpointError, match="older than step 4"):
        _signed_run(out, "latest")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("signed")
    run_subtests(_signed_run, 2, {}, args=(str(out),), timeout=240)
    return out / "checkpoints"


_key = key_env


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "checkpoints"
    shutil.copytree(run, target)
    return target


def _resume(checkpoints: Path, which: str = "latest") -> dict[str, object]:
    """What a resume does first: find the checkpoint, check it."""
    config = TrainConfig(**{**SETTINGS, "resume": which}, output_dir=str(checkpoints.parent))
    with _key(KEY):
        return load_trainer_state(find_checkpoint(checkpoints, which), config, True)


def test_the_signed_run_resumes_and_records_its_high_water_mark(run: Path) -> None:
    mark = json.loads((run / HIGH_WATER).read_text())
    assert mark["step"] == 4
    state = json.loads((run / "step-000004" / "trainer_state.json").read_text())
    assert state["run_id"] == mark["run_id"]
    assert _resume(run)["step"] == 4


def test_rollback_by_copy_rename_or_higher_step_is_refused(run: Path, tmp_path: Path) -> None:
    over = _copy(run, tmp_path / "over")  # the older one copied over the newest
    shutil.rmtree(over / "step-000004")
    shutil.copytree(over / "step-000002", over / "step-000004")
    with pytest.raises(CheckpointError, match=r"holds step 2 .signed., but its directory.s name"):
        _resume(over)
    renamed = _copy(run, tmp_path / "renamed")  # the newest gone, the older renamed over it
    shutil.rmtree(renamed / "step-000004")
    (renamed / "step-000002").rename(renamed / "step-000099")
    with pytest.raises(CheckpointError, match="name says step 99: it was copied or renamed"):
        _resume(renamed)
    higher = _copy(run, tmp_path / "higher")  # a higher number is not the newest: the mark is
    shutil.copytree(higher / "step-000002", higher / "step-000099")
    assert _resume(higher)["step"] == 4
    with pytest.raises(CheckpointError, match="holds step 2"):  # named: still not its name
        _resume(higher, str(higher / "step-000099"))


def test_rollback_by_deleting_the_newest_is_refused_unless_named(run: Path, tmp_path: Path) -> None:
    rolled = _copy(run, tmp_path / "rolled")
    shutil.rmtree(rolled / "step-000004")
    with pytest.raises(CheckpointError, match="older than step 4, the newest"):
        _resume(rolled)
    assert _resume(rolled, str(rolled / "step-000002"))["step"] == 2  # asked for by name


def test_another_runs_checkpoint_and_a_missing_or_edited_mark_are_refused(
    run: Path, tmp_path: Path
) -> None:
    other = _copy(run, tmp_path / "other")  # this directory now holds another run's mark
    write_high_water(other, HighWater("another-run", 4), KEY.encode())
    with pytest.raises(CheckpointError, match=r"was saved by run .* holds the checkpoints of run"):
        _resume(other)
    missing = _copy(run, tmp_path / "missing")
    (missing / HIGH_WATER).unlink()
    with pytest.raises(CheckpointError, match=f"{HIGH_WATER} is missing"):
        _resume(missing)
    assert _resume(missing, str(missing / "step-000004"))["step"] == 4
    edited = _copy(run, tmp_path / "edited")
    mark = json.loads((edited / HIGH_WATER).read_text())
    (edited / HIGH_WATER).write_text(json.dumps({**mark, "step": 2}))
    with pytest.raises(CheckpointError, match="its signature does not match"):
        _resume(edited)


def test_the_ranks_refuse_a_rollback_and_resume_a_named_checkpoint(
    run: Path, tmp_path: Path
) -> None:
    """Through the trainer on 2 ranks: latest after the newest was deleted
    is refused; the same checkpoint named with --resume PATH trains on."""
    rolled = _copy(run, tmp_path / "run")
    shutil.rmtree(rolled / "step-000004")
    run_subtests(_refused, 2, {}, args=(str(rolled.parent),), timeout=240)
    named = str(rolled / "step-000002")
    run_subtests(_signed_run, 2, {}, args=(str(rolled.parent), named), timeout=240)
    state = _resume(rolled)  # step 4 again, saved by the run that went back
    assert state["step"] == 4
    assert state["resumed_at"] == [2]
    assert json.loads((rolled / HIGH_WATER).read_text())["step"] == 4


@pytest.mark.parametrize("key", ["k", "8-bytes!", "x" * 31])
def test_a_short_key_is_refused(key: str, tmp_path: Path) -> None:
    env = {**os.environ, KEY_ENV: key}
    argv = [sys.executable, "-m", "pc_train.train", *fault_runs.argv(2), "--output-dir",
            str(tmp_path / "run")]  # fmt: skip
    done = fault_runs.run_command(argv, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"{KEY_ENV} holds {len(key)} byte(s)" in lines[0]
    assert "openssl rand -hex 32" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_latest_is_the_marks_step_and_named_links_resolve(run: Path, tmp_path: Path) -> None:
    """After a run went back (its mark below a newer checkpoint of the line
    it left), ``latest`` is the mark's step; a checkpoint named through a
    link loads as what it is."""
    back = _copy(run, tmp_path / "back")
    state = json.loads((back / "step-000004" / "trainer_state.json").read_text())
    write_high_water(back, HighWater(state["run_id"], 2), KEY.encode())
    assert _resume(back)["step"] == 2
    (back / "newest").symlink_to(back / "step-000004", target_is_directory=True)
    assert _resume(back, str(back / "newest"))["step"] == 4


def test_a_checkpoint_signed_before_marks_is_older_than_the_mark(run: Path, tmp_path: Path) -> None:
    """A checkpoint signed by an earlier version (no run id) in a directory
    that has a mark is refused for ``latest`` (it predates the mark), and
    loads when named."""
    old = _copy(run, tmp_path / "old")
    shutil.rmtree(old / "step-000004")
    checkpoint = old / "step-000002"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["run_id"]
    raw = json.dumps(state).encode()
    (checkpoint / "trainer_state.json").write_bytes(raw)
    (checkpoint / SIGNATURE).write_text(sign(raw, KEY.encode()))
    with pytest.raises(CheckpointError, match="signed by an earlier pc-train"):
        _resume(old)
    assert _resume(old, str(checkpoint))["step"] == 2
    (old / HIGH_WATER).unlink()  # no mark yet: as an earlier version left it
    assert _resume(old)["step"] == 2
