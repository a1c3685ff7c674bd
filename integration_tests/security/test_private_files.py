"""Issue 44, private by default: the directories pc-train creates for a
run (its output directory, the checkpoints, each step's checkpoint, the
logs) are readable by their owner only (0700), whatever the umask; a
directory the user made keeps its mode. pc-comm's shared-memory segments:
packages/pc-comm/tests/test_comm_shm.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))  # the fault tests' short runs
import fault_runs
import pytest

from pc_comm.testing import run_subtests
from pc_train.checkpoint import private_dir

pytestmark = pytest.mark.timeout(300)


def _mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def test_a_runs_checkpoints_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    out = tmp_path / "made-by-the-user"
    out.mkdir(mode=0o755)
    previous = os.umask(0o022)  # the usual umask: directories would be 0755
    try:
        run_subtests(fault_runs.train_with, 2, {}, args=(fault_runs.settings(2), str(out)),
                     timeout=240)  # fmt: skip
    finally:
        os.umask(previous)
    assert _mode(out) == "0o755"  # the user's own directory keeps its mode
    checkpoints = out / "checkpoints"
    assert _mode(checkpoints) == "0o700"
    steps = sorted(checkpoints.glob("step-*"))
    assert steps
    assert {_mode(step) for step in steps} == {"0o700"}


def test_private_dir_makes_every_missing_level_private(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    previous = os.umask(0o022)
    try:
        private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(previous)
    for level in ("a", "a/b", "a/b/c"):
        assert _mode(tmp_path / level) == "0o700", level
    assert _mode(tmp_path) == "0o755"  # the existing one untouched
