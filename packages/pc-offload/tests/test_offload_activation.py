"""CPUOffload gives the same gradients as plain training, at every ratio,
with and without activation checkpointing, on a tiny GPT-2 and a CNN."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pc_comm.testing import tiny_gpt2
from pc_offload import CopyEngine, CPUOffload, PinnedPool

pytestmark = pytest.mark.timeout(120)


class CNN(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.head = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.use_checkpoint:
            x = x + checkpoint(self.block, x, use_reentrant=False)
        else:
            x = x + self.block(x)
        out: torch.Tensor = self.head(torch.tanh(x).flatten(1))
        return out


def _gpt2(use_checkpoint: bool) -> nn.Module:
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    if use_checkpoint:
        kwargs = {"use_reentrant": False}
        hf: Any = model
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # older transformers
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def _loss(model: nn.Module, name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    if name == "gpt2":
        ids = torch.randint(0, 97, (4, 16), generator=gen)
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss
    x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    return nn.functional.cross_entropy(model(x), y)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


@pytest.mark.parametrize("name", ["cnn", "gpt2"])
@pytest.mark.parametrize("use_checkpoint", [False, True])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_gradients_match_without_offload(name: str, use_checkpoint: bool, ratio: float) -> None:
    torch.manual_seed(0)
    model = _gpt2(use_checkpoint) if name == "gpt2" else CNN(use_checkpoint)
    engine = CopyEngine(PinnedPool(64 << 20))
    tag = f"{name}-{use_checkpoint}-{ratio}"
    for step in range(3):  # the first forward calibrates the tag's total
        model.zero_grad(set_to_none=True)
        _loss(model, name, step).backward()  # type: ignore[no-untyped-call]
        expected = _grads(model)
        model.zero_grad(set_to_none=True)
        with CPUOffload(offload_ratio=ratio, tag=tag, engine=engine) as offload:
            loss = _loss(model, name, step)
        loss.backward()  # type: ignore[no-untyped-call]
        for got, want in zip(_grads(model), expected, strict=True):
            assert torch.equal(got, want)  # copies are exact: bit for bit
        stats = offload.stats
        assert stats.saved_bytes > 0
        if ratio == 0.0:
            assert stats.offloaded_tensors == 0
        else:
            assert stats.offloaded_tensors > 0, stats
            assert stats.offloaded_bytes <= ratio * stats.saved_bytes + 1, stats
        if ratio == 1.0:
            # Everything but parameters and tiny tensors moved.
            assert stats.offloaded_bytes > 0.5 * stats.saved_bytes, stats
        del loss
        gc.collect()
        assert engine.pool.stats().in_use_bytes == 0  # every host buffer came back
    if ratio > 0:
        pool = engine.pool.stats()
        assert pool.reuses > 0  # later steps reuse the first step's buffers
        assert pool.peak_reserved_bytes <= pool.max_bytes


def test_ratio_picks_the_earliest_activations() -> None:
    """With a known total, the first-saved tensors move, up to the ratio."""
    engine = CopyEngine(PinnedPool(16 << 20))
    x = torch.randn(64, 64, requires_grad=True)
    moved: list[int] = []

    def forward() -> torch.Tensor:
        h = x
        for _ in range(10):
            h = torch.tanh(h * 1.5)  # saves one 16 KiB tensor per layer
        return h.sum()

    for _ in range(2):
        with CPUOffload(offload_ratio=0.3, tag="picks", engine=engine) as offload:
            out = forward()
        out.backward()  # type: ignore[no-untyped-call]
        moved.append(offload.stats.offloaded_bytes)
    layer = 64 * 64 * 4
    # 20 saved tensors (input of *, output of tanh), 10 of them eligible
    # activations of 16 KiB; the leaf x itself is never moved.
    assert moved[1] <= 0.3 * offload.stats.saved_bytes
    assert moved[1] >= 0.3 * offload.stats.saved_bytes - layer


def test_bad_ratio_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"offload_ratio must be in \[0, 1\], got 1.5"):
        CPUOffload(offload_ratio=1.5)


def test_disabled_context_moves_nothing() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with CPUOffload(enable=False) as offload:
        y = torch.tanh(x).sum()
    y.backward()  # type: ignore[no-untyped-call]
    assert offload.stats.offloaded_tensors == 0
