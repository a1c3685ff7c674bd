"""ZeRO-3 parity: FullyShardedDataParallel and GeminiDDP against plain
single-process training of the same model on the same global batch, over
10 steps, at world sizes 2 and 4: a CNN and transformers' GPT-2, Llama and
BERT, with and without activation checkpointing, SGD with momentum (not
scale-invariant, so a wrong average shows) and AdamW, two param groups."""

from __future__ import annotations

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

from pc_comm.testing import run_subtests
from pc_zero import FullyShardedDataParallel, GeminiDDP, transformer_auto_wrap_policy

pytestmark = pytest.mark.timeout(600)

STEPS, GLOBAL_BATCH, LR = 10, 8, 0.02


def _wrap(kind: str, model: nn.Module, name: str) -> nn.Module:
    if kind == "fsdp":
        return FullyShardedDataParallel(
            model, auto_wrap_policy=transformer_auto_wrap_policy(block_classes(name))
        )
    if kind == "fsdp-keep":
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy(block_classes(name)),
            reshard_after_forward=False,
        )
    if kind == "gemini":  # about four chunks, so several gathers per step
        return GeminiDDP(model, chunk_size=chunk_size_for(model, 4))
    raise ValueError(kind)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    def message(m: str) -> str:
        return f"{what}: {m}"

    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=message)


def check_parity(kind: str, name: str, checkpointing: bool, optim: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build(name, checkpointing)
    model = _wrap(kind, build(name, checkpointing), name)
    lr = (
        LR if optim == "sgd" else 1e-3
    )  # Adam turns float noise in tiny gradients into lr-sized steps
    ref_opt = make_optimizer(optim, param_groups(named(reference), lr), lr)
    opt = make_optimizer(optim, param_groups(named(model), lr), lr)
    for step in range(STEPS):
        inputs = batch(name, step, GLOBAL_BATCH)
        ref_loss = loss_of(reference, inputs)
        ref_loss.backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model, rank_slice(inputs, rank, world))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    with model.summon_full_params():  # type: ignore[operator]
        ours = dict(named(model))
        for n, p in named(reference):
            assert_close(ours[n].detach(), p.detach(), n)


CASES: dict[str, list[object]] = {
    "kind": ["fsdp", "fsdp-keep", "gemini"],
    "name": ["cnn", "gpt2", "llama", "bert"],
    "checkpointing": [False, True],
    "optim": ["sgd"],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_single_process(world_size: int) -> None:
    run_subtests(check_parity, world_size, CASES, timeout=550)
