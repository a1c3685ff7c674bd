"""The CUDA path: NCCL picked by init_distributed, the rank pinned to its
device, collectives on device tensors. Runs with `nox -s gpu` on a GPU
machine; skipped elsewhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pc_comm.testing import find_free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = textwrap.dedent(
    """
    import torch
    from pc_comm import ReduceOp, TorchCommunicator, all_reduce_coalesced, init_distributed

    context = init_distributed()
    assert context.backend == "nccl", context.backend
    index = context.env.local_rank % torch.cuda.device_count()
    assert context.device == torch.device("cuda", index)
    assert torch.cuda.current_device() == context.device.index
    comm = TorchCommunicator()
    world = comm.world_size
    x = torch.arange(10, device=context.device, dtype=torch.float32) + comm.rank
    comm.all_reduce(x, ReduceOp.AVG)
    expected = torch.arange(10, device=context.device, dtype=torch.float32) + (world - 1) / 2
    torch.testing.assert_close(x, expected)
    ints = torch.full((5,), comm.rank * 3 + 1, device=context.device, dtype=torch.int64)
    comm.all_reduce(ints, ReduceOp.AVG)  # native on NCCL
    outs = [torch.empty(r + 2, device=context.device, dtype=torch.bfloat16) for r in range(world)]
    comm.all_gather_list(outs, torch.full((comm.rank + 2,), float(comm.rank), device=context.device,
                                          dtype=torch.bfloat16))
    for r, out in enumerate(outs):
        assert torch.all(out == r)
    grads = [torch.ones(7, device=context.device), torch.ones(3, device=context.device).half()]
    all_reduce_coalesced(comm, grads, ReduceOp.SUM)
    assert torch.all(grads[0] == world) and torch.all(grads[1] == world)
    print("gpu ok", world, flush=True)
    torch.distributed.destroy_process_group()
    """
)


def test_nccl_collectives_on_cuda_tensors(tmp_path: Path) -> None:
    script = tmp_path / "gpu_job.py"
    script.write_text(SCRIPT)
    nproc = torch.cuda.device_count()  # NCCL needs one device per rank
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{find_free_port()}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("gpu ok") == nproc
