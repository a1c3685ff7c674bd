"""Every schedule trains exactly as single-process training: 2 and 4
stages, interleaved chunks, activation checkpointing, DP2 x PP2 with
pc-comm DDP over the data-parallel group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from pipeline_models import batch, build_model, criterion
from torch import nn

from pc_comm import DistributedDataParallel, make_subgroups
from pc_comm.testing import run_subtests
from pc_pipeline import (
    GPipe,
    Interleaved1F1B,
    PipeDream,
    Pipeline,
    ZeroBubble,
    one_f_one_b,
    partition,
)

pytestmark = pytest.mark.timeout(300)

STEPS = 5
CHUNKS = 4
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb"]


def _optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # lr 1e-3: an Adam update divides by the gradient's own size, so where
    # microbatched and whole-batch gradients differ by fp32 rounding the
    # update differs in proportion to lr (lr 1e-2 gave 4.9e-6 on the AMD EPYC
    # CI machines, over atol 1e-6; the schedule itself is exact).
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _wrap(
    schedule: str,
    model: nn.Sequential,
    rank: int,
    size: int,
    group: dist.ProcessGroup | None,
    checkpoint: bool,
    dp_group: dist.ProcessGroup | None,
) -> Pipeline:
    chunks = 2 if schedule == "interleaved" else 1
    parts = partition(model, rank, size, num_model_chunks=chunks)
    stages: list[nn.Module] = list(parts) if isinstance(parts, list) else [parts]
    if dp_group is not None:
        stages = [DistributedDataParallel(s, process_group=dp_group) for s in stages]
    if schedule == "gpipe":
        return GPipe(stages[0], CHUNKS, group, checkpoint=checkpoint, scale_grads=True)
    if schedule == "1f1b":
        return PipeDream(stages[0], CHUNKS, group, checkpoint=checkpoint, scale_grads=True)
    if schedule == "interleaved":
        return Interleaved1F1B(stages, CHUNKS, group, checkpoint=checkpoint, scale_grads=True)
    return ZeroBubble(stages[0], CHUNKS, group, checkpoint=checkpoint, scale_grads=True)


def _reference(opt_kind: str, global_batch: int) -> tuple[nn.Sequential, list[torch.Tensor]]:
    model = build_model()
    opt = _optimizer(opt_kind, list(model.parameters()))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, global_batch)
        loss = criterion(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _train_and_compare(
    schedule: str,
    opt_kind: str,
    checkpoint: bool,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    dp_rank: int,
    dp_size: int,
) -> None:
    global_batch = 8 * dp_size
    ref_model, ref_losses = _reference(opt_kind, global_batch)
    model = build_model()
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    pipe = _wrap(schedule, model, pp_rank, pp_size, pp_group, checkpoint, dp_group)
    opt = _optimizer(opt_kind, list(pipe.parameters()))
    for step in range(STEPS):
        x, y = batch(step, global_batch)
        local = slice(dp_rank * 8, (dp_rank + 1) * 8)
        losses, outputs = pipe.forward_backward(
            x[local], criterion=criterion, labels=(y[local],), return_outputs=True
        )
        opt.step()
        opt.zero_grad()
        if pipe.is_last_stage:
            assert losses is not None
            assert losses.shape == (CHUNKS,)
            mean = losses.mean()
            if dp_group is not None:
                dist.all_reduce(mean, group=dp_group)
                mean /= dp_size
            torch.testing.assert_close(mean, ref_losses[step], rtol=1e-5, atol=1e-6)
            assert outputs is not None
            assert outputs.shape == (8, 4)
        else:
            assert losses is None
            assert outputs is None
    owned = {id(p) for p in pipe.parameters()}
    compared = 0
    for (name, p), (_, q) in zip(
        model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        if id(p) in owned:
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max())
            compared += 1
    assert compared > 0
    # Evaluation forward: the last stage returns the model's output.
    x, _ = batch(99, 8)
    out = pipe(x)
    if pipe.is_last_stage:
        with torch.no_grad():
            torch.testing.assert_close(out, ref_model(x), rtol=1e-5, atol=1e-6)
    else:
        assert out is None


def check_schedule_parity(schedule: str, opt_kind: str, checkpoint: bool) -> None:
    _train_and_compare(schedule, opt_kind, checkpoint, None, None, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_matches_single_process(world_size: int) -> None:
    run_subtests(
        check_schedule_parity,
        world_size,
        {"schedule": SCHEDULES, "opt_kind": ["sgd", "adamw"], "checkpoint": [False, True]},
        timeout=240,
    )


def check_dp_pp_parity(schedule: str) -> None:
    dp_group, pp_group = make_subgroups(pp_size=2)
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    _train_and_compare(schedule, "adamw", False, pp_group, dp_group, dp_rank, dp_size)


def test_dp2_x_pp2_matches_single_process() -> None:
    run_subtests(check_dp_pp_parity, 4, {"schedule": SCHEDULES}, timeout=240)


def check_bad_setups_raise_on_every_rank() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build_model()
    stage = partition(model, rank, size)
    assert isinstance(stage, nn.Module)
    with pytest.raises(ValueError, match=r"at least 2 microbatches"):
        PipeDream(stage, 1)
    with pytest.raises(ValueError, match=r"chunks must be a positive int"):
        GPipe(stage, 0)
    with pytest.raises(TypeError, match=r"list of model chunks"):
        Interleaved1F1B(stage, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pass one module per stage"):
        Pipeline([stage, stage], 4, one_f_one_b)  # 1F1B runs one stage per rank
    pipe = GPipe(stage, 4, timeout=3.0)
    x, y = batch(0, 6)
    with pytest.raises(ValueError, match=r"batch size 6, which does not split into chunks=4"):
        pipe.forward_backward(x, criterion=criterion, labels=(y,))

    def per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).mean(-1)

    x, y = batch(0, 8)
    if pipe.is_last_stage:
        with pytest.raises(TypeError, match=r"criterion must return a scalar"):
            pipe.forward_backward(x, criterion=per_sample, labels=(y,))
    else:
        # The last stage failed: this rank must not wait for it forever.
        with pytest.raises(RuntimeError, match=r"while waiting for 0RECV_B0 from rank 1"):
            pipe.forward_backward(x, criterion=criterion, labels=(y,))
    # No collective after this: gloo closes a pair whose operation timed out,
    # so the group is done (as a real job would be after such an error).


def test_bad_setups_raise_clear_errors() -> None:
    run_subtests(check_bad_setups_raise_on_every_rank, 2, {}, timeout=120)
