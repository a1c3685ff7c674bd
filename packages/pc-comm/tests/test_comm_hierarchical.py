"""HierarchicalCommunicator across two real torchrun agents on this machine
(two "nodes" of two ranks each), found from torchrun's environment: every
collective, and DDP training, against the single-process result."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pc_comm.testing import find_free_port

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

TESTS = Path(__file__).resolve().parent

JOB = textwrap.dedent(
    f"""
    import itertools, sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    import test_comm_collectives as collectives
    import test_comm_ddp as ddp
    from pc_comm import HierarchicalCommunicator, init_distributed

    context = init_distributed()
    comm = HierarchicalCommunicator(slot_bytes=4096)  # nodes from GROUP_RANK
    assert comm.nodes == [[0, 1], [2, 3]], comm.nodes
    assert (comm.num_nodes, comm.local_size) == (2, 2)
    collectives._COMMS["hier_env"] = comm
    for kind, dtype, size, async_op in itertools.product(
        collectives.KINDS, collectives.DTYPES, collectives.SIZES, [False, True]
    ):
        collectives.check_collective(kind, dtype, size, async_op, backend="hier_env")
    collectives._COMMS["hier_big"] = HierarchicalCommunicator()
    for kind in ["all_reduce", "reduce_scatter", "all_gather"]:
        for dtype in collectives.DTYPES[:2]:
            collectives.check_large(kind, dtype, backend="hier_big")
    ddp._COMMS["hier"] = comm
    for model_name, accumulate in [("cnn_unused", 2), ("gpt2", 1)]:
        ddp.check_ddp(model_name, "hier", accumulate, bucket_cap_mb=0.01)
    print(f"hierarchical parity OK on rank {{context.env.rank}}", flush=True)
    """
)


def test_two_agents_pass_hierarchical_parity(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = find_free_port()
    logs = [tmp_path / f"agent{node}.log" for node in range(2)]
    procs = []
    for node, log in enumerate(logs):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--rdzv-id", "pc-hier", "--max-restarts", "0"),
            str(script),
        ]
        with log.open("w") as sink:  # files, not pipes: see test_comm_launch
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT))
    try:
        for proc in procs:
            proc.wait(timeout=360)
    finally:
        for proc in procs:
            proc.kill()
    output = "".join(log.read_text() for log in logs)
    assert all(proc.returncode == 0 for proc in procs), output[-5000:]
    for rank in range(4):
        assert f"hierarchical parity OK on rank {rank}" in output, output[-5000:]
