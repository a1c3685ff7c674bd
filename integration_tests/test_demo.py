"""The main job end to end: pc-train on 2 local processes learns."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_pc_train_learns_on_two_processes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pc_booster.train", "--steps", "60", "--log-every", "20"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 gloo rank(s)" in result.stdout
    match = re.search(
        r"train loss ([\d.]+) -> ([\d.]+).*held-out loss ([\d.]+) -> ([\d.]+)", result.stdout
    )
    assert match, result.stdout
    first, last, eval_start, eval_end = map(float, match.groups())
    assert last < first - 1.0, result.stdout  # ln(256) = 5.5 at the start
    assert eval_end < eval_start - 1.0, result.stdout


def test_pc_train_rejects_bad_options() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pc_booster.train", "--model", "gpt9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice: 'gpt9'" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pc_booster.train", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "steps must be at least 1, got 0" in result.stderr
