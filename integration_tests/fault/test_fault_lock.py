"""Issue 44, one run per --output-dir [Note: the run lock] in pc_train.lock:
a second pc-train run in a directory another run holds is refused before
any rank starts (exit 2), naming the holder's host, pid and start time; a
lock file left by a run that died (SIGKILL: the kernel has released the
lock, the file still names it) is taken over with a line saying so, and
the run trains."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import fault_runs
import pytest

from pc_train.lock import LOCK_NAME
from pc_train.train import main

pytestmark = pytest.mark.timeout(300)

HOLD = """
import sys, time
from pc_train.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_run_in_a_held_directory_is_refused(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
            main([*fault_runs.argv(2), "--output-dir", str(tmp_path)])
        assert stop.value.code == 2, err.getvalue()
        message = err.getvalue()
        assert f"--output-dir {tmp_path} is in use by another pc-train run" in message
        assert f"pid {holder.pid}, started" in message
        assert not (tmp_path / "checkpoints").exists()  # nothing ran
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    left = {"host": "somewhere", "pid": dead.pid, "started": time.time() - 60}
    (tmp_path / LOCK_NAME).write_text(json.dumps(left))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        main([*fault_runs.argv(2), "--output-dir", str(tmp_path), "--no-progress",
              "--no-tensorboard", "--eval-every", "0"])  # fmt: skip
    assert "taking over the lock" in err.getvalue(), err.getvalue()
    assert f"pid {dead.pid}" in err.getvalue()
    assert (tmp_path / "checkpoints" / "step-000002").is_dir()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released at the end
