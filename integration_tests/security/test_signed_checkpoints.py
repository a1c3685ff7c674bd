"""Issue 44, signed checkpoints: with ``PC_CHECKPOINT_KEY`` set, pc-train
signs its checkpoints ([Note: signed checkpoints] in ``pc_train.signing``)
and a resume or a ``pc-export`` refuses one that was tampered with, even
when the forger rewrote every CRC-32 to match (which CRC-32 alone accepts:
shown below without the key). Refused too: an unsigned checkpoint while
the key is set, one signed with another key, and a trainer state edited
after signing. A signed checkpoint loads without the key, as an unsigned
one; the key is written nowhere."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))  # the fault tests' short runs
import fault_runs
import pytest
from signing_env import key_env

from pc_booster.checkpoint.checksum import CHECKSUMS, file_checksum
from pc_comm.testing import run_subtests
from pc_train.checkpoint import CheckpointError, load_trainer_state
from pc_train.export import main as export_main
from pc_train.signing import HIGH_WATER, KEY_ENV, SIGNATURE
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(300)

KEY = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"
SETTINGS = fault_runs.settings(2)


def _signed_run(out: str) -> None:
    os.environ[KEY_ENV] = KEY
    try:
        fault_runs.train_with(SETTINGS, out)
    finally:
        del os.environ[KEY_ENV]


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("signed")
    run_subtests(_signed_run, 2, {}, args=(str(out),), timeout=240)
    return out / "checkpoints" / "step-000002"


_key = key_env


def _load(path: Path) -> None:
    load_trainer_state(path, TrainConfig(**SETTINGS, output_dir=str(path.parent.parent)), True)


def _copy(signed: Path, tmp_path: Path) -> Path:
    """The checkpoint, with its directory's signed high-water mark."""
    target = tmp_path / "checkpoints" / signed.name
    shutil.copytree(signed, target)
    shutil.copy(signed.parent / HIGH_WATER, target.parent / HIGH_WATER)
    return target


def _forge_shard(path: Path) -> None:
    """What a forger without the key does: change a model shard, then
    every CRC-32 that covers it (the sidecar, the trainer state's)."""
    shard = path / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    sidecar = path / "model" / CHECKSUMS
    sums = json.loads(sidecar.read_text())
    sums["__0_0.distcp"] = file_checksum(shard)
    sidecar.write_text(json.dumps(sums))
    state = json.loads((path / "trainer_state.json").read_text())
    state["checksums"]["model/__0_0.distcp"] = file_checksum(shard)
    state["checksums"][f"model/{CHECKSUMS}"] = file_checksum(sidecar)
    state["files"][f"model/{CHECKSUMS}"] = sidecar.stat().st_size
    (path / "trainer_state.json").write_text(json.dumps(state))


def test_a_signed_checkpoint_loads_with_its_key_and_without(signed: Path) -> None:
    assert (signed / SIGNATURE).read_text().startswith("hmac-sha256:")
    state = json.loads((signed / "trainer_state.json").read_text())
    assert set(state["sha256"]) == set(state["files"])
    for file in signed.rglob("*"):  # the key is written nowhere
        if file.is_file():
            assert KEY.encode() not in file.read_bytes(), file
    with _key(KEY):
        _load(signed)
    with _key(None):
        _load(signed)


def test_a_forged_shard_is_refused_with_the_key(signed: Path, tmp_path: Path) -> None:
    forged = _copy(signed, tmp_path)
    _forge_shard(forged)
    with _key(None):  # CRC-32 alone: the forger's checksums hold
        _load(forged)
    with _key(KEY), pytest.raises(CheckpointError, match="its signature does not match"):
        _load(forged)  # the trainer state changed with the checksums


def test_a_forged_shard_under_the_signed_state_is_refused(signed: Path, tmp_path: Path) -> None:
    """The trainer state kept as signed (its signature holds): the shard's
    SHA-256 names it."""
    forged = _copy(signed, tmp_path)
    shard = forged / "model" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    with _key(KEY), pytest.raises(CheckpointError, match=r"model/__1_0\.distcp was changed"):
        _load(forged)


def test_unsigned_or_other_keys_are_refused(signed: Path, tmp_path: Path) -> None:
    unsigned = _copy(signed, tmp_path)
    (unsigned / SIGNATURE).unlink()
    with _key(KEY), pytest.raises(CheckpointError, match=f"is not signed, and {KEY_ENV} is set"):
        _load(unsigned)
    other = "another key of at least thirty-two bytes"
    with _key(other), pytest.raises(CheckpointError, match="signature does not match"):
        _load(signed)


def test_pc_export_checks_the_signature(signed: Path, tmp_path: Path) -> None:
    forged = _copy(signed, tmp_path)
    _forge_shard(forged)
    out = tmp_path / "exported"
    err = io.StringIO()
    with _key(KEY), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        export_main([str(forged), str(out)])
    assert stop.value.code == 2
    assert "its signature does not match" in err.getvalue(), err.getvalue()
    assert not out.exists() or not any(out.iterdir())
    with _key(KEY):
        export_main([str(signed), str(tmp_path / "good")])
    assert (tmp_path / "good" / "config.json").is_file()


def _resume(out: str, expect: str | None) -> None:
    os.environ[KEY_ENV] = KEY
    try:
        settings = {**SETTINGS, "resume": "latest"}
        if expect is None:
            fault_runs.train_with(settings, out)
        else:
            with pytest.raises(CheckpointError, match=expect):
                fault_runs.train_with(settings, out)
    finally:
        del os.environ[KEY_ENV]


def test_ranks_check_the_signature_on_resume(signed: Path, tmp_path: Path) -> None:
    """Inside the ranks (no launcher): the ranks split the SHA-256 checks and
    every rank raises the mismatch one of them found."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    _copy(signed, good)
    forged = _copy(signed, bad)
    shard = forged / "optimizer" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    run_subtests(_resume, 2, {}, args=(str(good), None), timeout=240)
    expect = r"optimizer/__1_0\.distcp was changed after the checkpoint was signed"
    run_subtests(_resume, 2, {}, args=(str(bad), expect), timeout=240)
