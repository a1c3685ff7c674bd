"""HierarchicalCommunicator across two real torchrun agents on this machine
(two "nodes" of two ranks each), found from torchrun's environment: every
collective, and DDP training, against the single-process result."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pc_comm.testing import find_free_port, run_torchrun_agents

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
    codes, output = run_torchrun_agents(
        script,
        nodes=2,
        nproc_per_node=2,
        port=find_free_port(),
        logs=tmp_path,
        timeout=360,
        run_id="pc-hier",
    )
    assert codes == [0, 0], output[-5000:]
    for rank in range(4):
        assert f"hierarchical parity OK on rank {rank}" in output, output[-5000:]
