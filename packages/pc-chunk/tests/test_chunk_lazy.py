"""LazyInitContext: recorded construction replays to exactly the eager values,
in any order, without touching the caller's random stream; what cannot be
deferred runs for real; misuse is explained."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from pc_chunk import LazyInitContext, is_lazy, materialize, materialize_, materialize_module
from pc_comm.testing import tiny_gpt2


class Net(nn.Module):
    """Layers whose init uses views, generators, conversions and data-
    dependent values, as real model code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=3)  # normal_, then a row through a view
        self.conv = nn.Conv2d(2, 4, 3)  # kaiming_uniform_
        self.norm = nn.BatchNorm1d(6)  # buffers, num_batches_tracked from torch.tensor(0)
        self.proj = nn.Linear(6, 5)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)  # uniform_, erfinv_, clamp_ ...
        nn.init.orthogonal_(self.conv.weight)  # qr of a scratch tensor, then copy_
        gen = torch.Generator().manual_seed(7)
        self.extra = nn.Parameter(torch.randn(3, 4, generator=gen))  # an explicit generator
        steps = torch.arange(0, 6, 2, dtype=torch.int64).float() / 6
        self.register_buffer("inv_freq", 1.0 / (10000**steps), persistent=False)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)))
        self.scale = float(self.proj.weight.abs().max().item())  # needs a real value
        with torch.no_grad():
            self.proj.bias.copy_(self.embed.weight[0, :5])  # copy from another lazy tensor
            self.proj.weight[:, 0].mul_(2.0)  # in place through a view


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=8,
    )
    model: nn.Module = transformers.BertForMaskedLM(config)
    return model


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "net": Net,
    "gpt2": lambda: tiny_gpt2(50, 8),
    "llama": _llama,
    "bert": _bert,
}


def _everything(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return dict(named)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_replay_equals_eager_construction_in_any_order(name: str) -> None:
    torch.manual_seed(0)
    eager = BUILDERS[name]()
    after_eager = torch.rand(8)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = BUILDERS[name]()
    # The caller's random stream is where eager construction leaves it.
    assert torch.equal(torch.rand(8), after_eager)
    tensors = _everything(lazy)
    # Lazy tensors look like eager ones (model code may check), but hold
    # nothing; only what was built from Python data (torch.tensor(0)) is real.
    assert all(is_lazy(t) or t.numel() <= 1 for t in tensors.values())
    assert any(is_lazy(t) for t in tensors.values())
    for t in tensors.values():
        assert t.device.type == "cpu"
        assert not t.is_meta
    expected = _everything(eager)
    assert tensors.keys() == expected.keys()
    # Materialise in a shuffled order, while drawing random numbers in between.
    names = list(tensors)
    random.Random(1).shuffle(names)
    for key in names:
        torch.rand(3)
        value = materialize(tensors[key]) if is_lazy(tensors[key]) else tensors[key]
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value, expected[key]), key
    materialize_module(lazy)
    for key, value in _everything(lazy).items():
        assert not is_lazy(value), key
        assert torch.equal(value, expected[key]), key


def test_materialize_in_place_keeps_identity_ties_and_grad_flags() -> None:
    torch.manual_seed(0)
    eager: Any = tiny_gpt2(50, 8)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy: Any = tiny_gpt2(50, 8)
    head = lazy.get_output_embeddings().weight
    embed = lazy.get_input_embeddings().weight
    assert head is embed  # tied: one parameter
    embed.requires_grad_(False)
    returned = materialize_(embed)
    assert returned is embed
    assert isinstance(embed, nn.Parameter)
    assert not embed.requires_grad
    assert lazy.get_output_embeddings().weight is embed
    assert torch.equal(embed, eager.get_input_embeddings().weight)
    assert not is_lazy(embed)
    assert is_lazy(lazy.transformer.h[0].attn.c_attn.weight)


def test_materialize_to_a_device_and_later_mutations() -> None:
    torch.manual_seed(0)
    with LazyInitContext():
        layer = nn.Linear(4, 3)
        before = layer.weight.clone()  # a copy at version "after init"
        with torch.no_grad():
            layer.weight.add_(1.0)
    torch.manual_seed(0)
    plain = nn.Linear(4, 3)
    assert torch.equal(materialize(before), plain.weight.detach())
    assert torch.equal(materialize(layer.weight, "cpu"), plain.weight.detach() + 1.0)


def test_errors_are_explained() -> None:
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"inside LazyInitContext.*meta tensor without a recipe"):
        materialize(meta.weight)
    with pytest.raises(ValueError, match="a cpu tensor"):
        materialize(torch.zeros(2))
