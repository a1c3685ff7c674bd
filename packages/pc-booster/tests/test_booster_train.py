"""pc-train's configuration, corpus and data order (the end-to-end run is in
integration_tests/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pc_booster.train import TrainConfig, _batch_offsets, load_byte_corpus


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt9'"):
        TrainConfig(model="gpt9")
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr must be positive"):
        TrainConfig(lr=0.0)


def test_corpus_reads_bytes_from_file_dir_and_stdlib(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b.py").write_bytes(b"world!")
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 10)
    tokens = load_byte_corpus(str(tmp_path), limit=100)
    assert bytes(tokens.to(torch.uint8).tolist()) == b"helloworld!"
    assert load_byte_corpus(str(tmp_path / "a.txt"), limit=3).tolist() == list(b"hel")
    stdlib = load_byte_corpus(None, limit=10_000)
    assert stdlib.numel() == 10_000
    assert stdlib.dtype == torch.int64
    assert int(stdlib.max()) < 256
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        load_byte_corpus(str(tmp_path / "missing"), limit=10)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        load_byte_corpus(str(empty), limit=10)


def test_global_batch_is_a_function_of_seed_and_step() -> None:
    config = TrainConfig(seed=3)
    a, b = _batch_offsets(config, 7, 10_000), _batch_offsets(config, 7, 10_000)
    assert torch.equal(a, b)
    assert not torch.equal(a, _batch_offsets(config, 8, 10_000))
    assert int(a.max()) < 10_000 - config.seq_len
