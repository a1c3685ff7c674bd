"""ZeRO-3 beyond plain parity: Gemini's one gather per chunk per pass under
activation checkpointing, model-state accounting against 16Ψ/N, a device
budget below the model states, mixed precision and fp16 overflow, sharded
checkpoints across world sizes, and the errors users get."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    rank_slice,
)

from pc_chunk import LazyInitContext
from pc_comm import Handle, TorchCommunicator
from pc_comm.testing import run_subtests, spawn, tiny_gpt2
from pc_zero import (
    FullyShardedDataParallel,
    GeminiDDP,
    GeminiOptimizer,
    MixedPrecision,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    transformer_auto_wrap_policy,
    zero_paper_bytes,
)

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 8


class CountingComm(TorchCommunicator):
    """Counts all-gathers by output size (a chunk's payload)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: dict[int, int] = {}

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        self.gathers[output.numel()] = self.gathers.get(output.numel(), 0) + 1
        return super().all_gather(output, input, async_op=async_op)


def check_gathers(checkpointing: bool) -> None:
    """After the first step, every chunk is all-gathered exactly once in
    forward and once in backward, with or without recomputation, prefetch
    included; the chunk of GPT-2's tied embedding (used first and last in
    forward) is kept from forward into backward, so it is gathered once per
    step. The communicator's own count must agree with the chunks'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = CountingComm()
    model = build("gpt2", checkpointing)
    wrapped = GeminiDDP(model, chunk_size=chunk_size_for(model, 4), comm=comm)
    chunks = wrapped.chunks
    assert len(chunks) >= 3, chunks
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    for step in range(4):
        comm.gathers.clear()
        before = [c.gathers for c in chunks]
        loss = loss_of(wrapped, rank_slice(batch("gpt2", step, GLOBAL_BATCH), rank, world))
        forward = [c.gathers - b for c, b in zip(chunks, before, strict=True)]
        loss.backward()  # type: ignore[no-untyped-call]
        backward = [c.gathers - b - f for c, b, f in zip(chunks, before, forward, strict=True)]
        opt.step()
        opt.zero_grad()
        by_size: dict[int, int] = {}
        for chunk, f, b in zip(chunks, forward, backward, strict=True):
            by_size[chunk.size] = by_size.get(chunk.size, 0) + f + b
        assert comm.gathers == by_size, (comm.gathers, by_size)
        if step == 0:
            continue
        kept = [c in wrapped.manager._sticky for c in chunks]
        assert sum(kept) == 1, kept  # the tied embedding's chunk
        assert forward == [1] * len(chunks), (step, forward)
        assert backward == [0 if k else 1 for k in kept], (step, backward)


def test_gemini_gathers_each_chunk_once_per_pass() -> None:
    run_subtests(check_gathers, 2, {"checkpointing": [False, True]})


def check_accounting(kind: str) -> None:
    """Model states per rank after a step, bf16 compute with AdamW: 16Ψ/N."""
    world = dist.get_world_size()
    model = tiny_gpt2(vocab_size=512, positions=32, n_embd=64, n_layer=4)
    psi = sum(p.numel() for p in model.parameters())
    wrapped: FullyShardedDataParallel | GeminiDDP
    if kind == "gemini":
        wrapped = GeminiDDP(model, mixed_precision=torch.bfloat16)
    else:
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy(block_classes("gpt2")),
            mixed_precision=MixedPrecision(torch.bfloat16),
        )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 32))
    loss_of(wrapped, {"input_ids": ids, "labels": ids}).backward()  # type: ignore[no-untyped-call]
    opt.step()
    memory = wrapped.memory(opt)
    expected = zero_paper_bytes(3, psi, world, mixed=True)
    assert expected == pytest.approx(16 * psi / world)
    assert memory.total == pytest.approx(expected, rel=0.05), (memory, expected)
    assert memory.master == pytest.approx(4 * psi / world, rel=0.05)
    assert memory.optimizer_states == pytest.approx(8 * psi / world, rel=0.05)
    # Between steps only shards exist: no rank holds a whole parameter set.
    assert all(c.payload is None for c in wrapped.chunks)


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_state_accounting_is_16_psi_over_n(world_size: int) -> None:
    run_subtests(check_accounting, world_size, {"kind": ["gemini", "fsdp"]})


def check_budget(placement: str) -> None:
    """A device budget below the model states: parity with single-process
    training, some shards on the host, and the budget never exceeded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = build("gpt2"), build("gpt2")
    psi = sum(p.numel() for p in model.parameters())
    states = 16 * psi // world  # shards, gradient shards, Adam states
    chunk_size = chunk_size_for(model, 6)
    budget = states // 2 + 6 * chunk_size * 4
    wrapped = GeminiDDP(
        model,
        chunk_size=chunk_size,
        placement_policy="auto" if placement == "auto" else "static",
        offload_param_frac=0.6 if placement == "static" else 0.0,
        device_budget_bytes=budget,
    )
    assert budget < states + 2 * chunk_size * 4
    assert wrapped.budget is not None
    wrapped.budget.record = True
    on_host = [c for c in wrapped.chunks if not c.shard_on_device]
    assert 0 < len(on_host) < len(wrapped.chunks), wrapped.offload_param_frac
    opt = GeminiOptimizer(
        make_optimizer("adamw", [{"params": list(wrapped.parameters())}], 1e-3), wrapped
    )
    ref_opt = make_optimizer("adamw", [{"params": list(reference.parameters())}], 1e-3)
    for step in range(10):
        inputs = batch("gpt2", step, GLOBAL_BATCH)
        ref_loss = loss_of(reference, inputs)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(wrapped, rank_slice(inputs, rank, world))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    log = wrapped.budget.log
    assert log
    assert max(used for _, _, used in log) <= budget
    assert wrapped.budget.peak_bytes <= budget
    with wrapped.summon_full_params():
        ours = dict(wrapped.module.named_parameters())
        for name, p in reference.named_parameters():
            torch.testing.assert_close(ours[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)


def test_gemini_under_a_device_budget() -> None:
    run_subtests(check_budget, 2, {"placement": ["static", "auto"]})


def check_mixed_precision(kind: str, dtype: torch.dtype) -> None:
    """bf16/fp16 compute with fp32 masters follows the fp32 run within the
    compute dtype's precision; fp16 overflow skips the step on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = build("gpt2"), build("gpt2")
    if kind == "gemini":
        wrapped: nn.Module = GeminiDDP(model, mixed_precision=dtype)
    else:
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy(block_classes("gpt2")),
            mixed_precision=MixedPrecision(dtype),
        )
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())  # masters
    opt = GeminiOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-3), wrapped)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(5):
        inputs = batch("gpt2", step, GLOBAL_BATCH)
        ref_loss = loss_of(reference, inputs)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(wrapped, rank_slice(inputs, rank, world))
        opt.backward(loss.float())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().float())
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=2e-2, atol=2e-2)
    if dtype == torch.float16:
        scale = opt.loss_scale
        before = [p.detach().clone() for p in wrapped.parameters()]
        loss = loss_of(wrapped, rank_slice(batch("gpt2", 9, GLOBAL_BATCH), rank, world))
        opt.backward(loss.float() * (1e30 if rank == 0 else 1.0))  # overflows on rank 0 only
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters(), strict=True))
        assert opt.loss_scale <= scale


def test_mixed_precision() -> None:
    run_subtests(
        check_mixed_precision,
        2,
        {"kind": ["gemini", "fsdp"], "dtype": [torch.bfloat16, torch.float16]},
    )


def _losses_after(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        loss = loss_of(model, rank_slice(batch("gpt2", step, GLOBAL_BATCH), rank, world))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(float(mean) / world)
    return losses


def _wrapped(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build("gpt2")
    wrapped: nn.Module
    if kind.startswith("gemini"):
        in_backward = kind == "gemini-step-in-backward"
        gemini = GeminiDDP(model, chunk_size=chunk_size_for(model, 3), step_in_backward=in_backward)
        opt = torch.optim.AdamW(gemini.parameters(), lr=1e-3, eps=1e-6)
        return gemini, GeminiOptimizer(opt, gemini) if in_backward else opt
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=transformer_auto_wrap_policy(block_classes("gpt2"))
    )
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=1e-6)


def save_then_continue(directory: str, kind: str) -> None:
    model, opt = _wrapped(kind)
    _losses_after(model, opt, range(3))
    save_sharded_checkpoint(Path(directory) / "ckpt", model, opt)  # type: ignore[arg-type]
    losses = _losses_after(model, opt, range(3, 6))
    if dist.get_rank() == 0:
        (Path(directory) / "expected.json").write_text(json.dumps(losses))


def load_and_continue(directory: str, kind: str) -> None:
    model, opt = _wrapped(kind)
    load_sharded_checkpoint(Path(directory) / "ckpt", model, opt)  # type: ignore[arg-type]
    losses = _losses_after(model, opt, range(3, 6))
    expected = json.loads((Path(directory) / "expected.json").read_text())
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6), (losses, expected)


@pytest.mark.parametrize("kind", ["fsdp", "gemini", "gemini-step-in-backward"])
def test_sharded_checkpoint_saved_at_2_loads_at_1_and_4(kind: str, tmp_path: Path) -> None:
    spawn(save_then_continue, 2, args=(str(tmp_path), kind), timeout=120)
    spawn(load_and_continue, 1, args=(str(tmp_path), kind), timeout=120)
    spawn(load_and_continue, 4, args=(str(tmp_path), kind), timeout=120)


def check_errors() -> None:
    model = GeminiDDP(build("cnn"))
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="build the optimizer after GeminiDDP"):
        GeminiOptimizer(torch.optim.SGD([stray], lr=0.1), model)
    with pytest.raises(TypeError, match="needs the wrapped model"):
        GeminiOptimizer(torch.optim.SGD([stray], lr=0.1), nn.Linear(2, 2))  # type: ignore[arg-type]
    # 'auto' without a budget plans against the device's free memory (the
    # host's on a CPU-only machine), which holds this model whole.
    auto = GeminiDDP(build("cnn"), placement_policy="auto")
    assert all(c.shard_on_device for c in auto.chunks)
    with pytest.raises(ValueError, match=r"one of \['static', 'auto', 'cuda', 'cpu'\]"):
        GeminiDDP(build("cnn"), placement_policy="gpu")
    with pytest.raises(ValueError, match=r"e.g. \{GPT2Block\}"):
        transformer_auto_wrap_policy(set())
    with torch.device("meta"):
        on_meta = build("cnn")
    with pytest.raises(ValueError, match=r"'blocks.0.conv.weight' is on the meta device.*"):
        FullyShardedDataParallel(on_meta)
    with LazyInitContext():
        lazy = build("cnn")
    with pytest.raises(ValueError, match=r"built lazily.*drop the example inputs"):
        GeminiDDP(lazy, example_inputs=tuple(batch("cnn", 0, 2).values()))

    captured: list[str] = []

    def inside(_m: nn.Module, _a: Any) -> None:
        try:
            with model.summon_full_params():
                pass
        except RuntimeError as error:
            captured.append(str(error))

    handle = model.module.head.register_forward_pre_hook(inside)  # type: ignore[union-attr]
    b = batch("cnn", 0, 2)
    loss_of(model, b).backward()  # type: ignore[no-untyped-call]
    handle.remove()
    assert captured
    assert "between steps" in captured[0], captured


def test_errors_are_explained() -> None:
    spawn(check_errors, 2, timeout=60)
