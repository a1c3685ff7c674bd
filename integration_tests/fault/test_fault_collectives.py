"""Mismatched collectives: with ``init_distributed(debug_collectives=True)``
two ranks that call all-reduce with different shapes both raise, each
naming both sides' calls, instead of hanging or corrupting data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pc_comm import init_distributed

init_distributed(debug_collectives=True)
rank = dist.get_rank()
try:
    dist.all_reduce(torch.ones(4 if rank == 0 else 5))
    said = "no error"
except RuntimeError as error:
    said = str(error)
Path(sys.argv[1], f"rank{rank}.txt").write_text(said)
"""


def test_mismatched_collectives_are_reported_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    said = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert set(said) == {"rank0.txt", "rank1.txt"}, result.stdout + result.stderr[-2000:]
    for line in said.values():
        assert "Detected mismatch between collectives on ranks" in line, line
        assert "TensorShape=[4]" in line
        assert "TensorShape=[5]" in line
