"""DistributedDataParallel against single-process training on the global
batch: losses and parameters equal at fp32 tolerance, step after step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm import (
    Communicator,
    DistributedDataParallel,
    ReduceOp,
    ShmCommunicator,
    TorchCommunicator,
)
from pc_comm.testing import run_subtests, spawn, tiny_gpt2

pytestmark = pytest.mark.timeout(300)

STEPS, GLOBAL_BATCH = 5, 8


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


class SmallCNN(nn.Module):
    scale: torch.Tensor

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        # GroupNorm, not BatchNorm: per-rank batch statistics differ from the
        # global batch's by definition (SyncBatchNorm's business, not DDP's).
        self.norm = nn.GroupNorm(2, 8)
        self.register_buffer("scale", torch.ones(1))
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 5)
        self.unused = nn.Linear(3, 3) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv1(x))) * self.scale
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.head(x.flatten(1))
        return out


def _cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen), torch.randint(
        0, 5, (GLOBAL_BATCH,), generator=gen
    )


def _gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    return tiny_gpt2()


_COMMS: dict[str, Communicator] = {}  # test_comm_hierarchical adds its own


def _comm(backend: str) -> Communicator:
    if backend not in _COMMS:
        _COMMS[backend] = (
            ShmCommunicator(slot_bytes=8192) if backend == "shm" else TorchCommunicator()
        )
    return _COMMS[backend]


def _build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "gpt2":
        return _gpt2()
    return SmallCNN(with_unused=model_name == "cnn_unused")


def _optimizers(
    model_name: str, reference: nn.Module, ddp: nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The reference's optimizer and the DDP replica's, the same kind."""
    if model_name == "gpt2":
        # GPT-2's key bias has a mathematically zero gradient (softmax ignores
        # a shift), so it holds ~1e-12 of rounding noise whose sign depends on
        # summation order; Adam would turn that noise into full-lr steps.
        # SGD keeps the comparison about the reduction, not about noise.
        return (
            torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
        )
    return (
        torch.optim.AdamW(reference.parameters(), lr=1e-2),
        torch.optim.AdamW(ddp.parameters(), lr=1e-2),
    )


def _loss_of(
    model_name: str, model: nn.Module, step: int, micro: int, lo: int, hi: int
) -> torch.Tensor:
    """The loss of rows ``lo:hi`` of the global batch of ``(step, micro)``."""
    if model_name == "gpt2":
        gen = torch.Generator().manual_seed(1000 * step + micro)
        ids = torch.randint(0, 97, (GLOBAL_BATCH, 16), generator=gen)[lo:hi]
        out: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return out
    x, y = _cnn_batch(10 * step + micro)
    cnn_loss: torch.Tensor = nn.CrossEntropyLoss()(model(x[lo:hi]), y[lo:hi])
    return cnn_loss


def _accumulate(
    model_name: str,
    model: nn.Module,
    step: int,
    accumulate: int,
    rows: tuple[int, int],
    no_sync: Callable[[], AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """Backward over ``accumulate`` micro-batches (all but the last under
    ``no_sync`` when given); returns the summed loss."""
    total = torch.zeros(())
    for micro in range(accumulate):
        loss = _loss_of(model_name, model, step, micro, *rows) / accumulate
        if no_sync is not None and micro < accumulate - 1:
            with no_sync():
                _backward(loss)
        else:
            _backward(loss)
        total += loss.detach()
    return total


def _assert_grads_match(ddp: DistributedDataParallel, reference: nn.Module) -> None:
    for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters(), strict=True):
        if q.grad is not None:  # the averaged gradient itself, before any optimizer
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def _assert_params_match(
    ddp: DistributedDataParallel, reference: nn.Module, model_name: str, step: int
) -> None:
    for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
        if model_name == "cnn_unused" and name.startswith("unused"):
            assert p.grad is None  # unused everywhere: left alone, as torch DDP does


def check_ddp(
    model_name: str,
    backend: str,
    accumulate: int,
    bucket_cap_mb: float,
    as_view: bool = True,
    set_to_none: bool = True,
) -> None:
    comm = _comm(backend)
    rank, world = comm.rank, comm.world_size
    shard = GLOBAL_BATCH // world
    reference, local = _build(model_name), _build(model_name)
    if rank == 1:  # DDP must start every replica from rank 0's weights
        with torch.no_grad():
            for p in local.parameters():
                p.add_(1.0)
            for b in local.buffers():
                b.mul_(3.0)
    ddp = DistributedDataParallel(
        local,
        communicator=comm,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=model_name == "cnn_unused",
        gradient_as_bucket_view=as_view,
    )
    ref_opt, opt = _optimizers(model_name, reference, ddp)
    for step in range(STEPS):
        ref_opt.zero_grad()
        ref_total = _accumulate(model_name, reference, step, accumulate, (0, GLOBAL_BATCH))
        ref_opt.step()

        opt.zero_grad(set_to_none=set_to_none)
        rows = (rank * shard, (rank + 1) * shard)
        total = _accumulate(model_name, ddp, step, accumulate, rows, ddp.no_sync)
        _assert_grads_match(ddp, reference)
        opt.step()
        comm.all_reduce(total, ReduceOp.AVG)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
        _assert_params_match(ddp, reference, model_name, step)
    if backend == "torch":
        ddp.reducer.stop()
    assert dist.get_world_size() == world


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_process(world_size: int) -> None:
    run_subtests(
        check_ddp,
        world_size,
        {
            "model_name": ["cnn", "cnn_unused", "gpt2"],
            "backend": ["shm", "torch"],
            "accumulate": [1, 2],
            "bucket_cap_mb": [0.001, 25.0],
        },
        timeout=280,
    )


def test_ddp_gradient_layouts_match_single_process() -> None:
    """Separate gradient tensors, and gradients zeroed in place (so backward
    accumulates straight into the bucket views)."""
    run_subtests(
        check_ddp,
        2,
        {
            "model_name": ["cnn_unused", "gpt2"],
            "backend": ["shm", "torch"],
            "accumulate": [2],
            "bucket_cap_mb": [0.001],
            "as_view": [False, True],
            "set_to_none": [False],
        },
        timeout=280,
    )


def _unused_without_flag() -> None:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(SmallCNN(with_unused=True), communicator=TorchCommunicator())
    x, y = _cnn_batch(0)
    loss = nn.functional.cross_entropy(ddp(x), y)
    with pytest.raises(
        RuntimeError, match=r"received no gradient.*unused\.weight.*find_unused_parameters=True"
    ):
        _backward(loss)


def test_unused_parameter_without_flag_is_a_clear_error() -> None:
    spawn(_unused_without_flag, 2, timeout=60)
