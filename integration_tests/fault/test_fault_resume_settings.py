"""Issue 44, resume questions changed settings: a checkpoint resumed with
another --clip-norm, or with its model's config file edited since (an
activation changed), is refused naming the difference; --steps past the
saved learning-rate schedule is refused with the two ways forward, and
--extend-schedule stretches the schedule instead (the run then learns
after the old end: its learning rate is not 0)."""

from __future__ import annotations

import json
from pathlib import Path

import fault_runs
import pytest

from pc_comm.testing import run_subtests
from pc_train.checkpoint import CheckpointError, load_trainer_state
from pc_train.models import resolve_model
from pc_train.train import train
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def config_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-step run of a model given as a config file, checkpoint at step 2."""
    folder = tmp_path_factory.mktemp("model")
    file = folder / "config.json"
    resolve_model("gpt2-tiny", 16).config.to_json_file(str(file))
    settings = {**fault_runs.settings(2), "model": str(file)}
    return fault_runs.saved_run(settings, tmp_path_factory), file


def _config(out: Path, model: Path, **changes: object) -> TrainConfig:
    settings = {**fault_runs.settings(2), "model": str(model), **changes}
    return TrainConfig(**settings, output_dir=str(out))


def test_a_changed_clip_norm_is_refused(config_run: tuple[Path, Path]) -> None:
    out, model = config_run
    latest = out / "checkpoints" / "step-000002"
    load_trainer_state(latest, _config(out, model))  # as saved: accepted
    with pytest.raises(CheckpointError, match=r"clip_norm: saved 1\.0, now 0\.5"):
        load_trainer_state(latest, _config(out, model, clip_norm=0.5))


def test_an_edited_model_config_is_refused(config_run: tuple[Path, Path]) -> None:
    out, model = config_run
    original = model.read_text()
    fields = json.loads(original)
    fields["activation_function"] = "relu"  # was gelu_new; the file edited in place
    model.write_text(json.dumps(fields))
    latest = out / "checkpoints" / "step-000002"
    try:
        with pytest.raises(
            CheckpointError, match="activation_function: saved 'gelu_new', now 'relu'"
        ):
            load_trainer_state(latest, _config(out, model))
    finally:
        model.write_text(original)


def test_steps_past_the_schedule_are_refused_or_extended(config_run: tuple[Path, Path]) -> None:
    out, model = config_run
    latest = out / "checkpoints" / "step-000002"
    with pytest.raises(CheckpointError, match=r"--steps 4 goes past .* reaches 0 at step 2"):
        load_trainer_state(latest, _config(out, model, steps=4))
    load_trainer_state(latest, _config(out, model, steps=4, extend_schedule=True))


def _extended(out: str, model: str) -> None:
    config = _config(Path(out), Path(model), steps=4, extend_schedule=True, resume="latest")
    history = train(config, fault_runs.context())
    assert history["step"][-1] == 4


def test_an_extended_schedule_trains_on(config_run: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    out, model = config_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    run_subtests(_extended, 2, {}, args=(str(copy), str(model)), timeout=240)
    state = json.loads((copy / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["schedule_steps"] == 4
