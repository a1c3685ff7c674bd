"""Issue 44, pc-export cleans up: an export killed (SIGKILL) after some of
its shards are written leaves no index, so nothing loads it as complete;
the rerun removes what the killed one left (shards no index names,
temporary files) and leaves exactly the export, which ``from_pretrained``
loads with the model's values."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from pc_train.export import main as export_main
from pc_train.models import build_model, resolve_model

pytestmark = pytest.mark.timeout(300)

INDEX = "model.safetensors.index.json"


def _shards(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("model-*.safetensors")) if out.is_dir() else []


def test_a_killed_export_is_cleaned_up_by_the_rerun(tmp_path: Path) -> None:
    model = build_model(resolve_model("llama-medium", 16), seed=0)
    pretrained, sharded, out = tmp_path / "pretrained", tmp_path / "sharded", tmp_path / "out"
    model.save_pretrained(str(pretrained))  # type: ignore[operator]
    export_main(["--to-sharded", str(pretrained), str(sharded)])
    command = [sys.executable, "-m", "pc_train.export", str(sharded), str(out),
               "--size-per-shard", "1"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(_shards(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the export finished before it was killed"
    left = _shards(out)
    assert len(left) >= 3, left
    assert not (out / INDEX).exists()  # nothing names the partial export complete
    with pytest.raises((OSError, ValueError)):  # nor does from_pretrained take it for one
        transformers.AutoModelForCausalLM.from_pretrained(str(out))

    export_main([str(sharded), str(out), "--size-per-shard", "1"])  # the rerun
    named = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert {p.name for p in out.iterdir()} == named | {INDEX, "config.json"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)
