"""init_distributed under a real torchrun, end to end (one node and two)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pc_comm import init_distributed
from pc_comm.testing import find_free_port, run_torchrun_agents

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import torch
    from pc_comm import ReduceOp, TorchCommunicator, init_distributed

    context = init_distributed()
    assert context.backend == "gloo" and context.device == torch.device("cpu")
    again = init_distributed()  # idempotent
    assert again.env == context.env
    if context.env.local_rank == 0:
        print(f"node master of node {context.env.node_rank}", flush=True)
    comm = TorchCommunicator()
    t = torch.tensor([float(context.env.rank)])
    comm.all_reduce(t, ReduceOp.SUM)
    print(f"rank {context.env.rank}/{context.env.world_size} node {context.env.node_rank} "
          f"local {context.env.local_rank}/{context.env.local_world_size} sum {t.item()}",
          flush=True)
    # An orderly end: no rank tears its connections down while a peer still
    # uses them (gloo aborts, rarely, at exit with a live group).
    comm.barrier()
    torch.distributed.destroy_process_group()
    """
)


def _torchrun(tmp_path: Path, *extra: str) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return [sys.executable, "-m", "torch.distributed.run", *extra, str(script)]


def test_init_distributed_under_torchrun(tmp_path: Path) -> None:
    port = find_free_port()
    cmd = _torchrun(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0/2 node 0 local 0/2 sum 1.0" in result.stdout
    assert "rank 1/2 node 0 local 1/2 sum 1.0" in result.stdout
    assert result.stdout.count("node master of node 0") == 1


def test_two_torchrun_agents_form_two_nodes(tmp_path: Path) -> None:
    """Multi-node on one machine: two agents, two local ranks each."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    codes, output = run_torchrun_agents(
        script,
        nodes=2,
        nproc_per_node=2,
        port=find_free_port(),
        logs=tmp_path,
        timeout=150,
        run_id="pc-two-nodes",
    )
    assert codes == [0, 0], output[-3000:]
    for rank in range(4):
        assert f"rank {rank}/4 node {rank // 2} local {rank % 2}/2 sum 6.0" in output, output
    assert output.count("node master of node 0") == output.count("node master of node 1") == 1


def test_missing_environment_explains_how_to_launch() -> None:
    with pytest.raises(ValueError, match=r"RANK is not set.*torchrun"):
        init_distributed(environ={})


def test_nccl_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        init_distributed("nccl", environ=env)
    with pytest.raises(ValueError, match="unknown backend 'ncl'"):
        init_distributed("ncl", environ=env)
