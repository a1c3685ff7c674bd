"""Two nodes on one host: two torchrun agents (``--nnodes 2``, c10d
rendezvous on localhost), two workers each, so the launcher's node logic,
LOCAL_WORLD_SIZE and node-major ranks are real. Hybrid sharding (FSDP2's
2-D mesh and LowLevelZero's extra_dp_size) shards inside each node and
matches single-process training (``multinode/hybrid_sharding.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).parent / "multinode" / "hybrid_sharding.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_hybrid_sharding_on_two_nodes(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    job = uuid.uuid4().hex[:8]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
        str(WORKER), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = []
    for agent in agents:
        out, _ = agent.communicate(timeout=240)
        outputs.append(out)
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted(r["node"] for r in results) == [0, 0, 1, 1]
    assert all(r["local_world_size"] == 2 for r in results)
    for r in results:
        assert [run["plugin"] for run in r["runs"]] == [
            "fsdp-hybrid", "fsdp-hybrid-zero2", "zero2-two-level", "gemini-two-level",
        ]  # fmt: skip
