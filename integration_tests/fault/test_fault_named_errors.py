"""Issue 52, every refusal on load names the file, exit code 2 where the
user has the fix:

- a garbled DCP ``.metadata`` was a bare ``'utf-8' codec can't decode
  ...`` (or ``pickle data was truncated``) without the file's name;
- a ``model.safetensors.index.json`` naming a pickle (``pytorch_model.bin``)
  was a bare ``MemoryError`` (its first 8 bytes read as a header length),
  reported as out of memory, exit code 1;
- ``--model DIR`` whose ``pytorch_model.bin`` pickles code was refused with
  torch's raw message, exit code 1; ``--model DIR/pytorch_model.bin`` was
  "not a usable config: 'utf-8' codec can't decode ...";
- ``--seq-len 100000000`` was refused with the disk size two checkpoints
  of a model that long would take, not naming the sequence length;
- a rank out of memory (``ulimit -v``) whose peer, seeing its connection
  close, exited first with code 1 made the job exit 1 under its "out of
  memory" line: torch's launcher records the first exit it polls."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import fault_runs
import pytest
import torch

from pc_booster.checkpoint import files
from pc_booster.checkpoint.checksum import ChecksumError, verify_safetensors
from pc_train.export import main as export_main
from pc_train.train import main as train_main

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))  # plant: the attacker's tools
from plant import plant_pt

pytestmark = pytest.mark.timeout(300)

BASE = ["--model", "gpt2-tiny", "--plugin", "ddp", "--steps", "2", "--eval-every", "0",
        "--no-tensorboard", "--no-progress", "--timeout", "10"]  # fmt: skip


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """pc-train's refusal of ``argv`` before any rank starts: its stderr."""
    with pytest.raises(SystemExit) as stop:
        train_main(argv)
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured.err
    assert "starting" not in captured.out, captured.out  # no rank started
    assert "Traceback" not in captured.err
    return captured.err


def _sharded(path: Path) -> Path:
    """A one-process sharded checkpoint (DCP) of a model's tensors."""
    from torch.distributed.checkpoint.state_dict_saver import save

    state = {"model/weight": torch.arange(12.0).reshape(3, 4), "model/bias": torch.ones(3)}
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _garble(metadata: Path, how: str) -> None:
    data = bytearray(metadata.read_bytes())
    if how == "bytes-flipped":
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
    else:  # cut short
        del data[len(data) // 2 :]
    metadata.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bytes-flipped", "cut-short"])
def test_a_garbled_dcp_metadata_is_named(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pc_zero import read_metadata

    checkpoint = _sharded(tmp_path / "model")
    _garble(checkpoint / ".metadata", how)
    named = f"{checkpoint / '.metadata'} is not readable DCP metadata: it is garbled or cut short ("
    with pytest.raises(ValueError) as refused:
        read_metadata(checkpoint)
    assert str(refused.value).startswith(named), refused.value
    with pytest.raises(SystemExit) as stop:  # pc-export reads it first
        export_main([str(checkpoint), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.startswith(f"pc-export: error: {named}"), err


def _pretrained(directory: Path) -> dict[str, torch.Tensor]:
    """A gpt2-tiny ``save_pretrained``-like directory: config.json and the
    weights in pytorch_model.bin. Returns the weights."""
    from pc_train.models import build_model, resolve_model

    model = build_model(resolve_model("gpt2-tiny", 64), seed=0)
    directory.mkdir()
    config: Any = model.config
    config.to_json_file(str(directory / "config.json"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, directory / "pytorch_model.bin")
    return state


def test_a_safetensors_index_naming_a_pickle_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    directory = tmp_path / "model"
    state = _pretrained(directory)
    keys = sorted(state)
    first = {k: state[k] for k in keys[:3] if k != "lm_head.weight"}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"), {"format": "pt"})
    shard = {k: "model-00001-of-00002.safetensors" if k in first else "pytorch_model.bin"
             for k in keys}  # fmt: skip
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": shard}))
    named = f"{index} names pytorch_model.bin, which is not a safetensors file"
    # pc-train --model DIR: before any rank starts.
    err = _refused(
        [*BASE, "--model", str(directory), "--output-dir", str(tmp_path / "run")], capsys
    )
    assert f"pc-train: error: {named}" in err, err
    # Booster.load_model's check of a transformers directory, on every rank.
    with pytest.raises(ChecksumError, match=named):
        files.verify_safetensors_files(directory, collective=False)
    # The file itself, read as safetensors: named, no allocation of what
    # its first 8 bytes claim.
    with pytest.raises(ChecksumError) as refused:
        verify_safetensors(directory / "pytorch_model.bin")
    message = str(refused.value)
    assert message.startswith(f"{directory / 'pytorch_model.bin'} is not a safetensors file ("), (
        message
    )
    assert "it is a pickle (torch.save's format)" in message, message


def test_a_model_pickle_that_runs_code_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "model"
    _pretrained(directory)
    marker = tmp_path / "ran"
    weights = directory / "pytorch_model.bin"
    plant_pt(weights, marker)
    # --model DIR: each rank refuses the file as it builds the model.
    done = fault_runs.run_command(
        [sys.executable, "-m", "pc_train.train", *BASE, "--model", str(directory),
         "--output-dir", str(tmp_path / "run")],
    )  # fmt: skip
    err = done.stderr
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for rank in (0, 1):
        expected = (
            f"pc-train: error: rank {rank} in start-up: UnsafeCheckpointError: {weights} holds a "
            "pickled object pc does not load (unpickling it could run code): "
        )
        assert expected in err, err[-3000:]
    assert "posix.system" in err, err[-3000:]
    assert not marker.exists()
    # --model DIR/pytorch_model.bin: the file is a weights file, never read.
    err = _refused([*BASE, "--model", str(weights), "--output-dir", str(tmp_path / "run2")], capsys)
    assert f"{weights} is a weights file, not a config; pass the directory" in err, err
    assert not marker.exists()


def test_an_absurd_seq_len_is_named_before_the_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused([*BASE, "--seq-len", "100000000", "--output-dir", str(tmp_path)], capsys)
    assert err.startswith(
        "pc-train: error: --seq-len 100,000,000 is longer than a preset model takes (1,048,576 "
        "tokens: its position table grows with --seq-len)"
    ), err
    assert "disk" not in err, err


class _Exit:
    """A rank's exit as torch's launcher records it."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode, self.timestamp = exitcode, time.time()

    def signal_name(self) -> str:
        return ""


class _Failed:
    def __init__(self, failures: dict[int, Any]) -> None:
        self.failures = failures


def test_a_rank_out_of_memory_makes_the_job_exit_2_when_a_peer_exits_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 runs out of memory (``ulimit -v``) and says so; while it tears
    down, rank 0 sees its connection close and exits 1 at once, and torch's
    launcher, which records the first exit it polls, reports rank 0 alone:
    the job must still exit 2, the code of the line it prints."""
    from pc_train.failures import ERROR_DIR, fail, note
    from pc_train.launch import _report_failure
    from pc_train.train_config import TrainConfig

    errors = tmp_path / "errors"
    errors.mkdir()
    monkeypatch.setenv(ERROR_DIR, str(errors))
    monkeypatch.setenv("RANK", "1")
    oom = (
        "rank 1 in save of step 3: out of memory: an allocation failed at the address-space "
        "limit (ulimit -v, RLIMIT_AS) of 1.2 GiB (RuntimeError: can't start new thread)"
    )
    with pytest.raises(SystemExit) as left:
        fail(oom, 2)
    assert left.value.code == 2
    monkeypatch.setenv("RANK", "0")
    note("error: rank 0 failed in save of step 3: rank 1: its process is gone", overwrite=True)
    with pytest.raises(SystemExit) as job:
        _report_failure(_Failed({0: _Exit(1)}), errors, TrainConfig(output_dir=str(tmp_path)))
    err = capsys.readouterr().err
    assert f"pc-train: error: {oom}" in err, err
    assert job.value.code == 2, err
