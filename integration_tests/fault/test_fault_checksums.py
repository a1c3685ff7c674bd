"""Checkpoints garbled at their full size: 64 bytes inside one tensor's data
changed, every file's size as it was written. Each is refused at load,
naming the file, instead of loading the wrong weights: a ``pc-train``
checkpoint's model shard (before any rank starts, exit code 2; and by the
ranks' own loads), a Booster ``model.safetensors`` (directory and file
forms), a Booster sharded save and an ``export_pretrained`` shard.
Checkpoints written without checksums (earlier versions, other tools)
still load."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import fault_runs
import pytest
import torch
import torch.distributed as dist

from pc_booster import Booster, LowLevelZeroPlugin, TorchDDPPlugin
from pc_comm.testing import run_subtests, spawn, tiny_gpt2
from pc_train.checkpoint import CheckpointError, load_trainer_state
from pc_train.train import main, train
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(300)

SETTINGS: dict[str, Any] = fault_runs.settings(2)
ARGV = fault_runs.argv(2)
GARBLED = 64


def _flip(file: Path, offset: int) -> None:
    """Invert ``GARBLED`` bytes of ``file`` at ``offset``: same size, other bytes."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(GARBLED)
        assert len(data) == GARBLED
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))


def garble_distcp(directory: Path, name: str) -> None:
    """64 bytes in the middle of the largest tensor DCP stored in ``name``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    items = [info for info in storage.values() if info.relative_path == name]
    largest = max(items, key=lambda info: info.length)
    assert largest.length >= 4 * GARBLED, largest
    _flip(directory / name, largest.offset + largest.length // 2)


def garble_safetensors(file: Path) -> None:
    """64 bytes in the middle of the largest tensor of a safetensors file."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    begin, end = max(spans, key=lambda span: span[1] - span[0])
    assert end - begin >= 4 * GARBLED
    _flip(file, 8 + length + (begin + end) // 2)


# -- pc-train ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with a checkpoint at step 2."""
    return fault_runs.saved_run(SETTINGS, tmp_path_factory)


def _garbled_run(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    latest = out / "checkpoints" / "step-000002"
    garble_distcp(latest / "model", "__1_0.distcp")
    return out, latest


def test_pc_train_refuses_a_garbled_model_shard_before_any_rank_starts(
    saved_run: Path, tmp_path: Path
) -> None:
    import contextlib
    import io

    out, latest = _garbled_run(saved_run, tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main([*ARGV, "--steps", "4", "--extend-schedule", "--output-dir", str(out), "--resume"])
    assert stop.value.code == 2, err.getvalue()
    assert f"checkpoint {latest} is corrupt: model/__1_0.distcp has checksum crc32:" in (
        err.getvalue()
    ), err.getvalue()
    assert "was written. Resume from an earlier checkpoint." in err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_pc_export_checks_the_trainer_states_sums_without_a_sidecar(
    saved_run: Path, tmp_path: Path
) -> None:
    """Issue 52: with ``model/.checksums.json`` removed and a shard garbled,
    pc-export refuses (it exported the wrong weights with exit code 0): the
    trainer state still holds every file's CRC-32."""
    from pc_train.export import main as export_main

    _, latest = _garbled_run(saved_run, tmp_path)
    (latest / "model" / ".checksums.json").unlink()
    out = tmp_path / "exported"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        export_main([str(latest), str(out)])
    assert stop.value.code == 2, err.getvalue()
    assert f"checkpoint {latest} is corrupt: model/__1_0.distcp has checksum" in err.getvalue()
    assert not out.exists() or not any(out.iterdir())


def _resume_refused_on_every_rank(out: str) -> None:
    config = TrainConfig(
        **{**SETTINGS, "steps": 4, "extend_schedule": True}, output_dir=out, resume="latest"
    )
    with pytest.raises(CheckpointError, match=r"is corrupt: __1_0\.distcp has checksum"):
        train(config, fault_runs.context())
    dist.barrier()  # every rank got here: each raised the error itself


def test_pc_train_ranks_refuse_a_garbled_model_shard(saved_run: Path, tmp_path: Path) -> None:
    """Launched without the preflight (torchrun, or train() itself): the
    ranks' loads check the shards, each rank a part of them."""
    out, _ = _garbled_run(saved_run, tmp_path)
    run_subtests(_resume_refused_on_every_rank, 2, {}, args=(str(out),), timeout=120)


def test_a_pc_train_checkpoint_without_checksums_still_loads(
    saved_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    latest = out / "checkpoints" / "step-000002"
    state = json.loads((latest / "trainer_state.json").read_text())
    state.pop("checksums", None)
    for sidecar in latest.rglob(".checksums.json"):
        del state["files"][str(sidecar.relative_to(latest))]
        sidecar.unlink()
    (latest / "trainer_state.json").write_text(json.dumps(state))
    config = TrainConfig(**{**SETTINGS, "steps": 4, "extend_schedule": True}, output_dir=str(out))
    assert load_trainer_state(latest, config)["step"] == 2


# -- Booster ----------------------------------------------------------------------


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _booster_full_saves(root: str) -> None:
    booster = Booster(plugin=TorchDDPPlugin())
    model = tiny_gpt2()
    model, *_ = booster.boost(model)
    for out, file in [
        (Path(root) / "full", Path(root) / "full" / "model.safetensors"),
        (Path(root) / "weights.safetensors", Path(root) / "weights.safetensors"),
    ]:
        booster.save_model(model, out)
        saved = {k: v.clone() for k, v in booster.plugin.model_state_dict(model).items()}
        booster.load_model(model, out)  # a whole file loads
        garble_safetensors(file)
        with pytest.raises(ValueError, match=rf"{file} is corrupt: tensor .* has checksum"):
            booster.load_model(model, out)
        with pytest.raises(ValueError, match=rf"{file} is corrupt"):
            Booster(plugin=TorchDDPPlugin()).load_model(tiny_gpt2(), out)  # not boosted
        # Another tool's file (no checksums in its header) loads as before.
        from safetensors.torch import save_file

        save_file(saved, str(file))
        booster.load_model(model, out)
        assert _states_equal(booster.plugin.model_state_dict(model), saved)


def test_booster_refuses_a_garbled_full_save(tmp_path: Path) -> None:
    spawn(_booster_full_saves, 1, args=(str(tmp_path),), timeout=120)


def _booster_sharded_saves(root: str) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    out = Path(root) / "sharded"
    booster.save_model(model, out, shard=True)
    booster.save_optimizer(optimizer, Path(root) / "optimizer", shard=True)
    booster.load_model(model, out)
    booster.load_optimizer(optimizer, Path(root) / "optimizer")
    dist.barrier()
    if dist.get_rank() == 0:
        garble_distcp(out, "__1_0.distcp")
    dist.barrier()
    with pytest.raises(ValueError, match=rf"{out} is corrupt: __1_0\.distcp has checksum"):
        booster.load_model(model, out)  # every rank raises it
    dist.barrier()
    if dist.get_rank() == 0:  # a save of earlier versions: no checksums, loads as before
        (out / ".checksums.json").unlink()
    dist.barrier()
    booster.load_model(model, out)

    pretrained = Path(root) / "pretrained"
    booster.export_pretrained(model, pretrained, size_per_shard=1)
    booster.load_model(model, pretrained)
    dist.barrier()
    index = json.loads((pretrained / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    if dist.get_rank() == 0:
        garble_safetensors(pretrained / shard)
    dist.barrier()
    with pytest.raises(ValueError, match=rf"{pretrained / shard} is corrupt: tensor .* has"):
        booster.load_model(model, pretrained)
    dist.barrier()


def test_booster_refuses_a_garbled_sharded_save(tmp_path: Path) -> None:
    spawn(_booster_sharded_saves, 2, args=(str(tmp_path),), timeout=180)


def test_pc_export_refuses_a_garbled_checkpoint(saved_run: Path, tmp_path: Path) -> None:
    """Issue 44: pc-export exported garbled bytes with exit 0 and wrote fresh
    checksums over them (which Booster.load_model then accepted); it now
    verifies the source's checksums first and writes nothing."""
    from pc_train.export import main as export_main

    _, latest = _garbled_run(saved_run, tmp_path)
    out = tmp_path / "exported"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        export_main([str(latest), str(out)])
    assert stop.value.code == 2, err.getvalue()
    assert "is corrupt: __1_0.distcp has checksum" in err.getvalue(), err.getvalue()
    assert not out.exists() or not any(out.iterdir())
