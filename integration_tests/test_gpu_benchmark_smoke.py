"""The GPU benchmark that searches for the largest model per GPU
(benchmarks/gpu_largest_model.py) runs on a CPU at a tiny size, so a GPU
session (short, and rare) never spends its time on a script that cannot
start. Gemini, Gemini stepping in backward and torch FSDP2 train the same
model from the same weights: their losses agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_largest_model.py"


def test_largest_model_search_runs_on_cpu() -> None:
    tiny = ["--layers", "2", "--width", "64", "--heads", "4", "--seq", "32", "--batch", "2",
            "--steps", "2", "--warmup", "1", "--timeout", "200"]  # fmt: skip
    frameworks = ["gemini", "gemini-step-in-backward", "fsdp2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "search", "--framework", *frameworks, *tiny],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert [row["framework"] for row in rows] == frameworks, done.stdout[-3000:]
    for row in rows:
        assert row["ok"], row
        assert len(row["losses"]) == 3
    # Same weights, same data, bf16 compute with fp32 masters and AdamW in
    # all three: the same losses to bf16's precision.
    reference = rows[2]["losses"]
    for row in rows[:2]:
        assert row["losses"] == pytest.approx(reference, rel=2e-3), (row, reference)
    assert rows[0]["losses"] == rows[1]["losses"]  # stepping in backward: the same update
    assert "| gemini-step-in-backward | 2 |" in done.stdout
