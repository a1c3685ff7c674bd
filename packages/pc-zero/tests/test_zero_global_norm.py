"""The global gradient norm across model-parallel groups [Note: global norm
across groups]: two ranks act as the two stages of a pipeline (each its own
data-parallel group of one), each holding half of a small model plus a
weight tied between the first and the last stage. Clipping must equal
single-process ``clip_grad_norm_`` over the whole model, and an fp16
overflow on one stage must skip the step on both; through
LowLevelZeroOptimizer and through ``unscale_clip_and_check`` with no
data-parallel communicator (full-gradient replicas)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import run_subtests
from pc_zero import (
    DynamicLossScaler,
    LossScaleConfig,
    LowLevelZeroOptimizer,
    ShardedOptimizer,
    unscale_clip_and_check,
)

pytestmark = pytest.mark.timeout(300)

CLIP = 0.05
# Adam divides the step by the gradient's RMS, which makes it blind to a
# uniform gradient scale (clipping) unless eps is comparable to the
# gradients: a large eps keeps the clipping coefficient visible.
EPS = 1e-2


class _Tied(nn.Module):
    """``tied`` is used by both stages: stage 0 embeds with it, stage 1
    projects back with its transpose (as GPT-2 ties wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tied = nn.Parameter(torch.randn(8, 8) * 0.5)
        self.b0 = nn.Parameter(torch.randn(8) * 0.1)
        self.l0 = nn.Linear(8, 8)
        self.l1 = nn.Linear(8, 8)
        self.c = nn.Parameter(torch.randn(8) * 0.1)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l0(torch.tanh(x @ self.tied.T + self.b0)))

    def last(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l1(h)) @ self.tied + self.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x))

    def stage_params(self, stage: int) -> list[torch.Tensor]:
        if stage == 0:
            return [self.tied, self.b0, self.l0.weight, self.l0.bias]
        return [self.l1.weight, self.l1.bias, self.tied, self.c]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).square().mean()


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's data-parallel group (itself alone) and the pipeline
    group (both ranks); every rank creates every group, in one order."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    pp = dist.new_group(list(range(dist.get_world_size())))
    return singles[dist.get_rank()], pp


def _pipeline_step(
    model: _Tied, opt: LowLevelZeroOptimizer, pp: dist.ProcessGroup, step: int
) -> None:
    """One step of a two-stage pipeline (one microbatch): activations and
    their gradients cross by send/recv; the tied weight's two gradients are
    summed across the stages before the step, as a pipeline engine does."""
    rank = dist.get_rank()
    x, y = _batch(step)
    with opt.no_sync():
        if rank == 0:
            h = model.first(x.to(opt.dtype))
            dist.send(h.detach(), 1)
            grad = torch.empty_like(h)
            dist.recv(grad, 1)
            h.backward(grad)  # type: ignore[no-untyped-call]
        else:
            h = torch.empty(16, 8, dtype=opt.dtype)
            dist.recv(h, 0)
            h.requires_grad_()
            opt.backward(_loss(model.last(h), y))
            assert h.grad is not None
            dist.send(h.grad, 0)
    dist.all_reduce(opt.accumulated_grad(model.tied), group=pp)
    opt.step()
    opt.zero_grad()


def _stage_optimizer(
    model: _Tied, norm_rule: str, loss_scale: LossScaleConfig | None = None
) -> tuple[LowLevelZeroOptimizer, dist.ProcessGroup]:
    """This rank's stage-1 ZeRO optimizer over its stage's parameters. The
    tied weight counts on stage 0 only: by an explicit predicate over a
    model-parallel group, or by the tensor-parallel default rule (its own
    parameters marked ``tensor_model_parallel``, the tied one replicated)."""
    rank = dist.get_rank()
    dp, pp = _groups()
    params = model.stage_params(rank)
    adamw = torch.optim.AdamW(params, lr=1e-3, eps=EPS, weight_decay=0.01)
    if norm_rule == "predicate":
        tied = model.tied
        opt = LowLevelZeroOptimizer(
            adamw,
            dp_process_group=dp,
            model_parallel_groups=[pp],
            counts_toward_norm=lambda p: p is not tied or rank == 0,
            max_norm=CLIP,
            loss_scale=loss_scale,
        )
    else:
        for p in params:
            if p is not model.tied:
                setattr(p, "tensor_model_parallel", True)  # noqa: B010
        opt = LowLevelZeroOptimizer(
            adamw,
            dp_process_group=dp,
            tp_process_group=pp,
            max_norm=CLIP,
            loss_scale=loss_scale,
        )
    return opt, pp


def check_clipping_matches_one_process(norm_rule: str) -> None:
    rank = dist.get_rank()
    model = _Tied()
    ref = _Tied()
    opt, pp = _stage_optimizer(model, norm_rule)
    sharded: ShardedOptimizer = opt  # mypy checks the structure statically...
    assert isinstance(sharded, ShardedOptimizer)  # ...and this at run time
    assert len(opt.params) == 4
    assert all(a is b for a, b in zip(opt.params, model.stage_params(rank), strict=True))
    assert opt.group_indices == ((0, 1, 2, 3),)
    assert opt.masters_are_params
    assert len(opt.model_parallel_groups) == 1
    assert opt.model_parallel_groups[0] is pp
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=EPS, weight_decay=0.01)
    for step in range(3):
        _pipeline_step(model, opt, pp, step)
        x, y = _batch(step)
        _loss(ref(x), y).backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        assert norm > 2 * CLIP  # the clipping is exercised
        ref_opt.step()
        ref_opt.zero_grad()
        for mine, expected in zip(model.stage_params(rank), ref.stage_params(rank), strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_clipping_spans_pipeline_stages_and_counts_tied_weight_once() -> None:
    run_subtests(
        check_clipping_matches_one_process, 2, {"norm_rule": ["predicate", "tensor_parallel"]}
    )


def check_overflow_on_one_stage(norm_rule: str) -> None:
    rank = dist.get_rank()
    model = _Tied().half()
    opt, pp = _stage_optimizer(
        model, norm_rule, LossScaleConfig(initial_scale=2.0**10, hysteresis=1)
    )
    assert isinstance(opt, ShardedOptimizer)
    assert not opt.masters_are_params
    _pipeline_step(model, opt, pp, 0)  # clean: the scale holds
    assert opt.loss_scale == 2.0**10
    params = [p.detach().clone() for p in opt.params]
    masters = [m.detach().clone() for m in opt.masters]

    hook = model.l1.weight.register_hook(  # type: ignore[no-untyped-call]
        lambda g: g * float("inf")  # on stage 1 only: stage 0 never uses l1
    )
    _pipeline_step(model, opt, pp, 1)
    hook.remove()
    assert opt.loss_scale == 2.0**9, (rank, opt.loss_scale)
    for before, p in zip(params, opt.params, strict=True):
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    for before, m in zip(masters, opt.masters, strict=True):
        torch.testing.assert_close(m, before, rtol=0, atol=0)

    _pipeline_step(model, opt, pp, 2)  # and training goes on
    assert any(not torch.equal(p, b) for p, b in zip(opt.params, params, strict=True))
    assert opt.loss_scale == 2.0**9


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    run_subtests(check_overflow_on_one_stage, 2, {"norm_rule": ["predicate", "tensor_parallel"]})


# -- plain optimizers: full gradients, no data-parallel communicator ---------------


def _stage_grads(model: _Tied, stage: int, scale: float) -> list[torch.Tensor]:
    """Full-model gradients of step 0's loss (times ``scale``), as this
    stage holds them: its own parameters' and the tied weight's (the sum
    of both stages' contributions)."""
    x, y = _batch(0)
    (_loss(model(x), y) * scale).backward()  # type: ignore[no-untyped-call]
    grads = []
    for p in model.stage_params(stage):
        assert p.grad is not None
        grads.append(p.grad.clone())
    return grads


def _ranges(model: _Tied, stage: int) -> list[list[tuple[int, int]]]:
    """Everything counts, except the tied weight on stage 1."""
    return [
        [] if p is model.tied and stage == 1 else [(0, p.numel())]
        for p in model.stage_params(stage)
    ]


def check_full_gradient_replicas(fp16_scale: bool) -> None:
    rank = dist.get_rank()
    _, pp = _groups()
    model = _Tied()
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=2.0**10, hysteresis=1))
    scale = scaler.scale if fp16_scale else 1.0
    grads = _stage_grads(model, rank, scale)
    ok, norm = unscale_clip_and_check(
        grads,
        None,
        scaler if fp16_scale else None,
        CLIP,
        torch.device("cpu"),
        count_ranges=_ranges(model, rank),
        model_parallel_groups=[pp],
    )
    ref = _Tied()
    x, y = _batch(0)
    _loss(ref(x), y).backward()  # type: ignore[no-untyped-call]
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    assert ok
    assert norm == pytest.approx(float(expected), rel=1e-5)
    for grad, p in zip(grads, ref.stage_params(rank), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6)

    if not fp16_scale:
        return
    # An inf in the tied weight's gradient on stage 1 only, where it does
    # not count towards the norm: both stages still see the overflow.
    grads = _stage_grads(_Tied(), rank, scaler.scale)
    if rank == 1:
        grads[2][0, 0] = float("inf")
    before = [g.clone() for g in grads]
    ok, norm = unscale_clip_and_check(
        grads,
        None,
        scaler,
        CLIP,
        torch.device("cpu"),
        count_ranges=_ranges(model, rank),
        model_parallel_groups=[pp],
    )
    assert not ok
    assert norm == float("inf")
    assert scaler.scale == 2.0**9
    for grad, old in zip(grads, before, strict=True):
        torch.testing.assert_close(grad, old, rtol=0, atol=0)


def test_unscale_clip_and_check_without_a_data_parallel_communicator() -> None:
    run_subtests(check_full_gradient_replicas, 2, {"fp16_scale": [False, True]})


def check_errors() -> None:
    _, pp = _groups()
    with pytest.raises(ValueError, match="twice"):
        unscale_clip_and_check(
            [torch.ones(2)], None, None, 1.0, torch.device("cpu"), model_parallel_groups=[pp, pp]
        )


def test_a_group_listed_twice_is_refused() -> None:
    run_subtests(check_errors, 2, {})
