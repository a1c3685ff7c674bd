"""GeminiDDP and FullyShardedDataParallel stepping each chunk inside
backward ([Note: stepping in backward]):
parity with single-process training, at most two gradient shards alive at
any time, no gradient memory kept between steps, and the settings it
refuses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero3_models import (
    batch,
    block_classes,
    build,
    chunk_size_for,
    loss_of,
    make_optimizer,
    named,
    param_groups,
    rank_slice,
)

from pc_chunk import Chunk, ChunkState
from pc_comm.testing import run_subtests, spawn
from pc_offload import HybridAdam
from pc_zero import (
    FullyShardedDataParallel,
    GeminiDDP,
    GeminiOptimizer,
    ShardedModule,
    transformer_auto_wrap_policy,
)

pytestmark = pytest.mark.timeout(400)

STEPS, GLOBAL_BATCH, LR = 10, 8, 1e-3


def _optimizer(kind: str, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    groups = param_groups(named, LR)  # two groups: decay and no decay
    if kind == "hybrid":
        return HybridAdam(groups, lr=LR, eps=1e-6)
    return make_optimizer(kind, groups, LR)


def check_parity(kind: str, name: str, offload: float, checkpointing: bool, optim: str) -> None:
    """10 steps against single-process training on the same global batch,
    with part of the chunks' shards on the host (``offload``; FSDP's
    ``offload_params`` is all or nothing)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = build(name, checkpointing), build(name, checkpointing)
    wrapped: ShardedModule
    if kind == "gemini":
        wrapped = GeminiDDP(
            model,
            chunk_size=chunk_size_for(model, 4),
            offload_param_frac=offload,
            step_in_backward=True,
        )
    else:
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy(block_classes(name)),
            offload_params=offload > 0,
            step_in_backward=True,
        )
    assert len(wrapped.chunks) >= 3
    ref_opt = _optimizer("adamw" if optim == "hybrid" else optim, named(reference))
    opt = GeminiOptimizer(_optimizer(optim, named(wrapped)), wrapped)
    # Watch every in-backward step: the chunks holding a finished gradient
    # shard at that moment (as the chunk's, or as its parameters' .grad
    # views): only the one being stepped. (The reduction in flight holds
    # the second, in its output buffer.)
    alive: list[int] = []
    step_chunk = opt._step_chunk

    def holds_grad(c: Chunk) -> bool:
        views = c.state is ChunkState.FREE and any(s.param.grad is not None for s in c.slots)
        return c.grad_shard is not None or views

    def watched(chunk: Chunk) -> None:
        alive.append(sum(holds_grad(c) for c in wrapped.chunks))
        step_chunk(chunk)

    wrapped.manager.on_reduced = watched
    for step in range(STEPS):
        inputs = batch(name, step, GLOBAL_BATCH)
        ref_loss = loss_of(reference, inputs)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        stepped_before = len(alive)
        loss = loss_of(wrapped, rank_slice(inputs, rank, world))
        opt.backward(loss)
        assert len(alive) - stepped_before == len(wrapped.chunks)  # all stepped in backward
        opt.step()
        opt.zero_grad()
        assert all(c.held_grad is None for c in wrapped.chunks)  # nothing kept between steps
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert max(alive) == 1, alive
    assert wrapped.memory(opt).grads == 0
    with wrapped.summon_full_params():
        ours = dict(named(wrapped.module))
        for n, p in named(reference):
            torch.testing.assert_close(ours[n].detach(), p.detach(), rtol=1e-5, atol=1e-6)


CASES: dict[str, list[object]] = {
    "kind": ["gemini", "fsdp"],
    "name": ["gpt2", "llama"],
    "offload": [0.0, 0.5],
    "checkpointing": [False, True],
    "optim": ["adamw"],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_step_in_backward_parity(world_size: int) -> None:
    cases: dict[str, list[object]] = dict(CASES)
    if world_size == 4:
        cases.update(name=["gpt2"], offload=[0.5], checkpointing=[True])
    run_subtests(check_parity, world_size, cases, timeout=380)


def test_step_in_backward_other_optimizers() -> None:
    run_subtests(
        check_parity,
        2,
        {
            "kind": ["gemini"],
            "name": ["gpt2"],
            "offload": [0.5],
            "checkpointing": [False],
            "optim": ["sgd", "hybrid"],
        },
        timeout=200,
    )


class _Swapping(nn.Module):
    """Two layers whose order flips with ``flip``: the order chunks are
    needed in changes from step to step, so prefetches recorded in the
    first step go astray."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.flip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        out: torch.Tensor = self.head(torch.tanh(second(torch.tanh(first(x)))))
        return out


def check_changing_order(kind: str) -> None:
    reference, model = _Swapping(), _Swapping()
    wrapped: ShardedModule
    if kind == "gemini":
        wrapped = GeminiDDP(model, chunk_size=64 * 65, step_in_backward=True)  # one per layer
    else:
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=transformer_auto_wrap_policy({nn.Linear}), step_in_backward=True
        )
    assert len(wrapped.chunks) >= 3

    def flip(step: int) -> None:
        reference.flip = model.flip = step % 3 == 1

    _train_against_reference(reference, model, wrapped, 8, flip)


def _train_against_reference(
    reference: nn.Module,
    model: nn.Module,
    wrapped: ShardedModule,
    steps: int,
    before_step: Callable[[int], None],
) -> None:
    """AdamW on both, the global batch of 8 split over the ranks; losses and
    every parameter compared after each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = GeminiOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=LR), wrapped)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        before_step(step)
        x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 4, generator=gen)
        ref_loss = (reference(x) - y).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = (wrapped(x[mine]) - y[mine]).square().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        with wrapped.summon_full_params():
            for (n, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(
                    q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}: {n}"
                )


def test_step_in_backward_when_the_order_changes() -> None:
    run_subtests(check_changing_order, 2, {"kind": ["gemini", "fsdp"]}, timeout=120)


class _Gated(nn.Linear):
    """A linear layer that, with ``bypass``, returns its input untouched:
    it runs (its chunk is gathered, and backward's pre-hook fires on its
    output) but its parameters get no gradient."""

    bypass = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.bypass else super().forward(x)


class _Skipping(nn.Module):
    """``c`` is used (``"use"``), left out (``"skip"``: backward's prefetch,
    recorded with ``c`` in the order, gathers its chunk anyway), run with
    its output thrown away (``"discard"``: its chunk may stay gathered from
    forward) or bypassed inside its own forward (``"bypass"``). In the last
    three its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.c, self.b = nn.Linear(64, 64), _Gated(64, 64), nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.use_c = "use"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        self.c.bypass = self.use_c == "bypass"
        if self.use_c in ("use", "bypass"):
            x = torch.tanh(self.c(x))
        elif self.use_c == "discard":
            self.c(x)
        out: torch.Tensor = self.head(torch.tanh(self.b(x)))
        return out


def check_skipped_layer(
    kind: str, in_backward: bool, prefetch: bool, reshard: bool, packed: bool
) -> None:
    """A layer left out of some steps gets no update in those steps (its
    gradient is None in single-process training, so AdamW skips it), with
    prefetch on or off, whether or not the step is taken in backward,
    (FSDP) with chunks kept from forward to backward (``reshard=False``),
    and with the layer alone in its chunk or sharing it with a layer that
    does get gradients (``packed``)."""
    if kind == "gemini" and not reshard:
        return  # Gemini has no reshard_after_forward
    reference, model = _Skipping(), _Skipping()
    wrapped: ShardedModule
    if kind == "gemini":
        size = 64 * 65 * (2 if packed else 1)  # packed: a and c share a chunk
        wrapped = GeminiDDP(model, chunk_size=size, step_in_backward=in_backward, prefetch=prefetch)
    else:
        wrapped = FullyShardedDataParallel(
            model,  # packed: one flat unit for the whole model
            auto_wrap_policy=None if packed else transformer_auto_wrap_policy({nn.Linear}),
            step_in_backward=in_backward,
            forward_prefetch=prefetch,
            reshard_after_forward=reshard,
        )

    def choose(step: int) -> None:
        reference.use_c = model.use_c = ("use", "skip", "discard", "bypass")[step % 4]

    _train_against_reference(reference, model, wrapped, 9, choose)


def test_a_skipped_layer_is_not_stepped() -> None:
    run_subtests(
        check_skipped_layer,
        2,
        {
            "kind": ["gemini", "fsdp"],
            "in_backward": [False, True],
            "prefetch": [True, False],
            "reshard": [True, False],
            "packed": [False, True],
        },
        timeout=200,
    )


def check_refusals() -> None:
    def model(**kwargs: object) -> GeminiDDP:
        return GeminiDDP(build("gpt2"), step_in_backward=True, **kwargs)  # type: ignore[arg-type]

    wrapped = model()
    with pytest.raises(ValueError, match=r"max_norm=1\.0.*step_in_backward=False"):
        GeminiOptimizer(torch.optim.AdamW(wrapped.parameters()), wrapped, max_norm=1.0)
    fp16 = model(mixed_precision=torch.float16)
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        GeminiOptimizer(torch.optim.AdamW(fp16.parameters()), fp16)
    # A plain optimizer cannot be stepped in backward: the first backward says so.
    plain = model()
    inputs = rank_slice(batch("gpt2", 0, GLOBAL_BATCH), dist.get_rank(), dist.get_world_size())
    with pytest.raises(RuntimeError, match=r"GeminiOptimizer\(optimizer, model\)"):
        loss_of(plain, inputs).backward()  # type: ignore[no-untyped-call]
    # Clipping after backward would clip nothing: refused.
    with pytest.raises(RuntimeError, match="nothing left to clip"):
        wrapped.clip_grad_norm_(1.0)
    # Accumulation: the second backward raises before it changes anything,
    # and training goes on after step() as if it had never been tried.
    accum, twin = model(), model()
    opt = GeminiOptimizer(torch.optim.AdamW(accum.parameters(), lr=LR), accum)
    twin_opt = GeminiOptimizer(torch.optim.AdamW(twin.parameters(), lr=LR), twin)
    opt.backward(loss_of(accum, inputs))
    shards = [c.shard.clone() for c in accum.chunks if c.shard is not None]
    states = [v.clone() for s in opt.state.values() for v in s.values()]
    with pytest.raises(RuntimeError, match=r"second backward before optimizer\.step"):
        opt.backward(loss_of(accum, inputs))
    after = [c.shard for c in accum.chunks if c.shard is not None]
    assert len(after) == len(shards) == len(accum.chunks)
    assert all(torch.equal(a, b) for a, b in zip(shards, after, strict=True))
    now = [v for s in opt.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(states, now, strict=True))
    later = rank_slice(batch("gpt2", 1, GLOBAL_BATCH), dist.get_rank(), dist.get_world_size())
    opt.step()
    opt.backward(loss_of(accum, later))
    opt.step()
    for data in (inputs, later):
        twin_opt.backward(loss_of(twin, data))
        twin_opt.step()
    for a, b in zip(accum.chunks, twin.chunks, strict=True):
        assert a.shard is not None
        assert b.shard is not None
        assert torch.equal(a.shard, b.shard), a.name


def test_step_in_backward_refusals() -> None:
    spawn(check_refusals, 2, timeout=120)
