"""pc-train's configuration, corpus, data order, plugin options and
checkpoint checks, without processes (the end-to-end runs are in
integration_tests/test_pc_train.py)."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from pc_train import hardware
from pc_train.checkpoint import CheckpointError, find_checkpoint, load_trainer_state
from pc_train.data import batch_offsets, load_byte_corpus, load_corpus
from pc_train.failures import EXIT_FAILURE, EXIT_USER_ERROR, describe_failure
from pc_train.hardware import peak_flops
from pc_train.launch import _bound_by_memory, _cpu_threads
from pc_train.models import resolve_model
from pc_train.options import PluginKind, PluginOptions
from pc_train.train_config import TrainConfig
from pc_train.trainer import _schedule, _schedule_steps


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown plugin 'zero9'"):
        TrainConfig(plugin="zero9")
    with pytest.raises(ValueError, match="steps must be an integer of at least 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr must be positive"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 0"):
        TrainConfig(checkpoint_every=-1)


def test_models_resolve_presets_configs_and_refuse_the_rest(tmp_path: Path) -> None:
    spec = resolve_model("llama-tiny", 64)
    assert (spec.family, spec.vocab_size, spec.layers, spec.hidden) == ("llama", 256, 2, 64)
    config = tmp_path / "opt.json"
    config.write_text(json.dumps(resolve_model("opt-tiny", 64).config.to_dict()))
    assert resolve_model(str(config), 64).family == "opt"
    with pytest.raises(ValueError, match="unknown model 'gpt9'"):
        resolve_model("gpt9", 64)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.json"), 64)
    config.write_text("{not json")
    with pytest.raises(ValueError, match="is not a usable config"):
        resolve_model(str(config), 64)


def test_corpus_reads_bytes_from_file_dir_and_stdlib(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b.py").write_bytes(b"world!")
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 10)
    tokens = load_byte_corpus(str(tmp_path), limit=100)
    assert bytes(tokens.to(torch.uint8).tolist()) == b"helloworld!"
    assert load_byte_corpus(str(tmp_path / "a.txt"), limit=3).tolist() == list(b"hel")
    nested = tmp_path / "nested"
    (nested / "deeper").mkdir(parents=True)
    (nested / "deeper" / "c.md").write_bytes(b"deep")
    assert bytes(load_corpus(str(nested), 100).tolist()) == b"deep"
    stdlib = load_byte_corpus(None, limit=10_000)
    assert stdlib.numel() == 10_000
    assert stdlib.dtype == torch.int64
    assert int(stdlib.max()) < 256
    with pytest.raises(ValueError, match="does not exist"):
        load_byte_corpus(str(tmp_path / "missing"), limit=10)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        load_byte_corpus(str(empty), limit=10)


def test_global_batch_is_a_function_of_seed_and_step() -> None:
    a, b = batch_offsets(3, 7, 16, 64, 10_000), batch_offsets(3, 7, 16, 64, 10_000)
    assert torch.equal(a, b)
    assert not torch.equal(a, batch_offsets(3, 8, 16, 64, 10_000))
    assert int(a.max()) < 10_000 - 64
    with pytest.raises(ValueError, match="too few for sequences of 64"):
        batch_offsets(0, 0, 16, 64, 60)


def test_plugin_options_are_checked_against_the_world() -> None:
    hybrid = PluginOptions(PluginKind.HYBRID, tp=2, pp=2)
    hybrid.check(8, "fp32", layers=4)
    assert hybrid.dp_size(8) == 2
    with pytest.raises(
        ValueError,
        match=r"tp_size \(2\) x pp_size \(2\) = 4 does not divide the world.*tp_size is --tp",
    ):
        hybrid.check(6, "fp32")
    with pytest.raises(
        ValueError, match="3 transformer blocks do not split evenly into 2 pipeline"
    ):
        hybrid.check(8, "fp32", layers=3)
    with pytest.raises(ValueError, match=r"max_norm=1\.0 cannot clip.*max_norm is --clip-norm"):
        PluginOptions(PluginKind.GEMINI, step_in_backward=True).check(2, "fp32", max_norm=1.0)
    with pytest.raises(ValueError, match="--tp hybrid, fsdp or gemini; zero2 is data parallel"):
        PluginOptions(PluginKind.ZERO2, tp=2).check(4, "fp32")
    PluginOptions(PluginKind.DDP).check(2, "fp16")  # torch's AMP: fp32 parameters, fp16 compute
    # zero_stage=0 in bf16: fp32 parameters under autocast (no longer refused)
    PluginOptions(PluginKind.HYBRID, tp=2, zero_stage=0).check(2, "bf16")
    with pytest.raises(ValueError, match="--offload-frac is an option of --plugin gemini"):
        PluginOptions(PluginKind.ZERO1, offload_frac=0.5).check(2, "fp32")
    with pytest.raises(ValueError, match="unknown plugin"):
        PluginOptions.parse("zero3")


def test_checkpoint_checks_refuse_missing_truncated_and_foreign(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(tmp_path, "latest")
    (tmp_path / "step-000010.partial").mkdir()  # a save that never finished
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(tmp_path, "latest")
    step = tmp_path / "step-000010"
    step.mkdir()
    assert find_checkpoint(tmp_path, "latest") == step
    config = TrainConfig()
    with pytest.raises(CheckpointError, match=r"trainer_state\.json is missing"):
        load_trainer_state(step, config)
    (step / "trainer_state.json").write_text("{")
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_trainer_state(step, config)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(step / "model.safetensors"))
    size = (step / "model.safetensors").stat().st_size
    state = {"step": 10, "config": config.to_dict(), "files": {"model.safetensors": size}}
    (step / "trainer_state.json").write_text(json.dumps(state))
    assert load_trainer_state(step, config)["step"] == 10
    with pytest.raises(CheckpointError, match=r"other settings .*seq_len: saved 64, now 32"):
        load_trainer_state(step, TrainConfig(seq_len=32))
    with pytest.raises(CheckpointError, match="past --steps 5"):
        load_trainer_state(step, TrainConfig(steps=5))
    with open(step / "model.safetensors", "r+b") as handle:
        handle.truncate(size - 1)
    with pytest.raises(CheckpointError, match=f"has {size - 1} bytes, {size} were written"):
        load_trainer_state(step, config)


def test_corpus_reads_a_datasets_directory(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # nox's test session installs it
    rows = {"text": ["first row", "second row"], "label": [0, 1]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    assert bytes(load_corpus(str(tmp_path / "ds"), 1000).tolist()) == b"first row\n\nsecond row"
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="reads a 'text' column"):
        load_corpus(str(tmp_path / "other"), 1000)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"clip_norm": math.nan}, "clip_norm must be a finite global norm >= 0"),
        ({"clip_norm": math.inf}, "clip_norm must be a finite global norm >= 0"),
        ({"lr": math.nan}, "lr must be positive and finite, got nan"),
        ({"lr": -math.inf}, "lr must be positive and finite, got -inf"),
        ({"weight_decay": math.inf}, "weight_decay must be finite and >= 0"),
        ({"timeout": math.inf}, "timeout must be a number of seconds > 0"),
        ({"timeout": math.nan}, "timeout must be a number of seconds > 0"),
        ({"timeout": 0.0}, "timeout must be a number of seconds > 0"),
        ({"offload_frac": math.nan}, "offload_frac must be a share in [0, 1]"),
    ],
)
def test_config_numbers_are_finite_and_in_range(setting: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**setting)  # type: ignore[arg-type]


def test_failures_are_told_apart_from_user_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TrainConfig(output_dir=str(tmp_path))
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.pt"))
    code, line = describe_failure(full, config)
    assert code == EXIT_USER_ERROR
    assert line.startswith(f"OSError: the disk is full writing {tmp_path / 'x.pt'} (")
    wrapped = ValueError("the sharded save failed")
    wrapped.__cause__ = full
    assert describe_failure(wrapped, config)[1].startswith("ValueError: the disk is full")
    read_only = OSError(errno.EROFS, "Read-only file system", str(tmp_path))
    code, line = describe_failure(read_only, config)
    assert (code, line.split(" (")[0]) == (
        EXIT_USER_ERROR, f"OSError: cannot write {tmp_path}: read-only file system",
    )  # fmt: skip
    bad = describe_failure(ValueError("bad\n  input"), config)
    assert bad == (EXIT_USER_ERROR, "ValueError: bad input")
    assert describe_failure(KeyError("oops"), config) == (EXIT_FAILURE, "KeyError: 'oops'")
    # torch.save's short write is a full disk where the disk is (nearly) full.
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    usage = shutil.disk_usage(tmp_path)
    for free, code in ((10**12, EXIT_FAILURE), (4096, EXIT_USER_ERROR)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, f=free: usage._replace(free=f))
        assert describe_failure(short, config)[0] == code, free


def test_the_cpu_peak_is_measured_on_the_rank_s_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FLOP count is per rank on torch.get_num_threads() threads; the
    peak it is divided by must be measured on as many."""
    asked: list[int] = []

    def measure(threads: int) -> float:
        asked.append(threads)
        return 1e9

    monkeypatch.setattr(hardware, "cpu_peak_flops", measure)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        peak, source = peak_flops(torch.device("cpu"), 1, "fp32")
    finally:
        torch.set_num_threads(previous)
    assert (asked, peak, source) == ([1], 1e9, "measured matmul, 1 thread(s) per rank")
    # The threads a rank trains with: the cores this process may use, shared.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert (_cpu_threads(1), _cpu_threads(2), _cpu_threads(4)) == (2, 1, 1)


def test_the_lr_schedule_keeps_the_length_it_was_saved_with() -> None:
    config = TrainConfig(steps=10, warmup=2)
    assert _schedule_steps(config, None) == 10
    assert _schedule_steps(config, {"schedule_steps": 4, "config": {"steps": 6}}) == 4
    assert _schedule_steps(config, {"config": {"steps": 6}}) == 6  # saved before it was recorded
    factor = _schedule(4, 2)
    assert [round(factor(s), 6) for s in range(7)] == [0.5, 0.853553, 0.5, 0.146447, 0, 0, 0]


def test_freed_memory_is_given_back_where_memory_is_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: host allocator]: a CPU rank keeps freed memory for speed,
    except where the run placed states on the host or the disk tier, or runs
    under a memory cap."""
    monkeypatch.delenv("PC_TRAIN_CGROUP", raising=False)
    assert not _bound_by_memory(TrainConfig(plugin="zero2"))
    assert not _bound_by_memory(TrainConfig(plugin="gemini"))
    assert _bound_by_memory(TrainConfig(plugin="zero2", cpu_offload=True))
    assert _bound_by_memory(TrainConfig(plugin="gemini", offload_frac=0.5))
    assert _bound_by_memory(
        TrainConfig(plugin="zero2", cpu_offload=True, nvme_offload_fraction=1.0)
    )
    monkeypatch.setenv("PC_TRAIN_CGROUP", "pc-test")
    assert _bound_by_memory(TrainConfig(plugin="zero2"))
