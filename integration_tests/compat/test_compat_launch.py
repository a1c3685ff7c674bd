"""A Colossal-AI training script's launch-level calls on pc, with only the
imports changed: written from Colossal-AI's public call shapes
(``colossalai.launch_from_torch(config={})``, ``colossalai.launch(config=,
rank=, world_size=, host=, port=, backend=, seed=, verbose=)``,
``DistCoordinator``, ``get_dist_logger``, ``get_accelerator``). The script
trains a small model data-parallel on 2 ranks and must match plain
single-process training on the whole batch (losses and parameters, several
steps); where pc refuses a call, the exact message. One spawn runs every
sub-case; each starts its own process group the way the script would."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm import DistributedDataParallel
from pc_comm.testing import find_free_port, run_subtests
from pc_compat.colossalai import launch, launch_from_torch
from pc_compat.colossalai.accelerator import get_accelerator
from pc_compat.colossalai.cluster import DistCoordinator
from pc_compat.colossalai.logging import get_dist_logger

pytestmark = pytest.mark.timeout(120)

SEED = 42
STEPS = 4
BATCH = 8
RTOL, ATOL = 1e-5, 1e-6


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _make_data(path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g))
        for _ in range(STEPS)
    ]
    torch.save(batches, path)


def _reference(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[nn.Module, list[float]]:
    """Single-process training on the whole batch, seeded as launch(seed=) promises."""
    torch.manual_seed(SEED)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _training_script(tmp: Path, entry: str) -> None:
    """What a Colossal-AI example does after launching."""
    coordinator = DistCoordinator()
    logger = get_dist_logger()
    accelerator = get_accelerator()
    device = accelerator.get_current_device()
    rank, world = coordinator.rank, coordinator.world_size
    log_file = logger.log_to_file(tmp / "logs", suffix=entry)

    # The model is built right after launch: seed= made it equal everywhere.
    model = _model().to(device)
    data_path = tmp / f"data-{entry}.pt"
    with coordinator.priority_execution():  # "download" once, the others read it
        if coordinator.is_master():
            _make_data(data_path)
        data = torch.load(data_path)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    accelerator.reset_peak_memory_stats()
    losses, printed = [], io.StringIO()
    for step, (x, y) in enumerate(data):
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = nn.functional.mse_loss(ddp(x[shard].to(device)), y[shard].to(device))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        accelerator.synchronize()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        peak_mb = accelerator.max_memory_allocated() / 1024**2  # scripts divide by it
        with contextlib.redirect_stdout(printed):
            coordinator.print_on_master(f"step {step} loss {losses[-1]:.6f} peak {peak_mb:.1f} MB")
        logger.info(f"step {step} done on rank {rank}", ranks=[0])
    coordinator.block_all()

    ref, ref_losses = _reference(data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)

    lines = printed.getvalue().splitlines()
    assert len(lines) == (STEPS if rank == 0 else 0), lines
    assert all(float(line.split()[-2]) > 0 for line in lines)  # real peak numbers
    logged = log_file.read_text()
    assert log_file.name == f"rank_{rank}_{entry}.log"
    assert (f"step {STEPS - 1} done on rank 0" in logged) == (rank == 0)
    assert "done on rank 1" not in logged


def _fresh_port_then_destroy() -> int:
    """A port for the next group, agreed through the current one, which then ends."""
    port = [find_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    DistCoordinator().destroy()
    return int(port[0])


def check_launch_from_torch(tmp: Path) -> None:
    """Under torchrun's variables (the harness sets them), on a new port."""
    os.environ["MASTER_PORT"] = str(_fresh_port_then_destroy())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        launch_from_torch(config={}, seed=SEED)
    rank = dist.get_rank()
    assert ("Distributed environment is initialized, world size: 2" in err.getvalue()) == (
        rank == 0
    )
    _training_script(tmp, "from_torch")


def check_launch(tmp: Path) -> None:
    """A process no launcher started: everything is in the arguments."""
    rank = dist.get_rank()
    port = _fresh_port_then_destroy()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(key, None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        launch(
            config={},
            rank=rank,
            world_size=2,
            host="127.0.0.1",
            port=port,
            backend="gloo",
            seed=SEED,
            verbose=True,
        )
    assert ("Distributed environment is initialized, world size: 2" in err.getvalue()) == (
        rank == 0
    )
    assert DistCoordinator().is_node_master() == (rank == 0)  # launch told it the local rank
    _training_script(tmp, "launch")


def check_refusals(tmp: Path) -> None:
    del tmp
    config_message = (
        "launch_from_torch(config=...) got a config with keys ['parallel'], and pc reads no "
        "config. Colossal-AI's config (parallel sizes, fp16, zero, gradient clipping) is given "
        "in pc as the options of the plugin passed to pc_booster.Booster, and the seed, backend "
        "and logging as arguments of this function (see docs/migrate-colossalai.md). Pass "
        "config={} or leave it out."
    )
    with pytest.raises(ValueError, match=re.escape(config_message)):
        launch_from_torch(config={"parallel": {"tensor": {"size": 2}}})
    with pytest.raises(
        ValueError, match=re.escape("launch(config=...) got the config file './cfg.py'")
    ):
        launch(config="./cfg.py", rank=0, world_size=2, host="127.0.0.1", port=29500)
    if not torch.cuda.is_available():
        # Colossal-AI's default backend where no GPU is visible: gloo (the
        # group the harness made is gloo, so it is kept).
        assert launch_from_torch(backend="nccl", verbose=False).backend == "gloo"
        message = (
            "set_per_process_memory_fraction has no meaning on the CPU accelerator (CUDA only)."
        )
        with pytest.raises(RuntimeError, match=re.escape(message)):
            get_accelerator().set_per_process_memory_fraction(0.5)


def _case(tmp: str, case: str) -> None:
    {
        "refusals": check_refusals,
        "launch_from_torch": check_launch_from_torch,
        "launch": check_launch,
    }[case](Path(tmp))


def test_colossal_launch_script_matches_single_process(tmp_path: Path) -> None:
    run_subtests(
        _case,
        2,
        {"case": ["refusals", "launch_from_torch", "launch"]},
        args=(str(tmp_path),),
        timeout=100,
    )
