"""pc-train and pc-estimate take any family with a transformers plan as a
``config.json`` (here Qwen2, which pc has no policy of its own for):
pc-estimate counts its parameters and the tensor-parallel share from the
config alone, and pc-train trains it under tensor and pipeline
parallelism."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from pc_train.estimate import model_shape  # noqa: E402
from pc_train.models import build_model, resolve_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _qwen2(tmp_path: Path) -> Path:
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    where = tmp_path / "qwen2"
    config.save_pretrained(where)
    return where


def test_estimate_counts_a_plan_family_from_its_config(tmp_path: Path) -> None:
    spec = resolve_model(str(_qwen2(tmp_path)), 32)
    shape = model_shape(spec)
    model = build_model(spec, seed=0)
    assert shape.params == sum(p.numel() for p in model.parameters())
    # What tp splits: the seven projections of each block (Qwen2's q/k/v
    # biases with them), the embedding and the LM head; the norms stay whole.
    expected = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith(("lm_head.", "model.embed_tokens.")) or "_proj." in name
    )
    assert shape.tp_sharded == expected


@pytest.mark.parametrize(
    "layout", [["--tp", "2"], ["--pp", "2"], ["--sp", "2", "--clip-norm", "0"]]
)
def test_pc_train_trains_a_plan_family_config(tmp_path: Path, layout: list[str]) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "pc_train.train", "--model", str(_qwen2(tmp_path)),
         "--plugin", "hybrid", *layout, "--steps", "3", "--nproc", "2", "--seq-len", "32",
         "--no-progress", "--no-tensorboard", "--eval-every", "0", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads((out / "report.json").read_text())["history"]["loss"]
    assert len(losses) == 3
    assert all(0 < loss < 10 for loss in losses)
