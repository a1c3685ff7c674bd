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

from pc_chunk import (
    ChunkManager,
    LazyInitContext,
    is_lazy,
    materialize,
    materialize_,
    materialize_module,
)
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


# -- dtype and device conversions [Note: conversions through .data] ---------------------


class Converted(nn.Module):
    """Conversions during construction, with steps and random draws on
    the converted tensors after them, next to a part left in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).to(torch.bfloat16)
        with torch.no_grad():
            self.a.weight.mul_(3.0)  # an in-place step on the converted tensor
        self.b = nn.Linear(4, 3).half()
        nn.init.normal_(self.b.weight)  # a random draw in float16
        self.c = nn.Linear(3, 2)  # stays float32
        self.d = nn.Linear(2, 2).double().float()  # converted there and back


CONVERSIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "to-bf16": lambda m: m.to(torch.bfloat16),
    "to-fp16": lambda m: m.to(torch.float16),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to-cpu-and-bf16": lambda m: m.to("cpu", torch.bfloat16),
    "bf16-then-float": lambda m: m.bfloat16().float(),
}


def _gpt2_converted(convert: Callable[[nn.Module], nn.Module]) -> nn.Module:
    return convert(tiny_gpt2(50, 8))


def _assert_same(lazy: nn.Module, eager: nn.Module) -> None:
    got, expected = _everything(lazy), _everything(eager)
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert not is_lazy(value), key
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value, expected[key]), key


@pytest.fixture(params=[False, True], ids=["set-data", "swap-tensors"])
def swap_on_conversion(request: pytest.FixtureRequest) -> Any:
    """Both ways nn.Module._apply converts a parameter: ``param.data = new``
    (the default) and ``torch.utils.swap_tensors``."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(bool(request.param))
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_conversion_inside_the_context_is_replayed(
    conversion: str, swap_on_conversion: Any
) -> None:
    convert = CONVERSIONS[conversion]
    torch.manual_seed(0)
    eager: Any = _gpt2_converted(convert)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy: Any = _gpt2_converted(convert)
    weight = lazy.transformer.wte.weight
    assert is_lazy(weight)
    assert weight.dtype == eager.transformer.wte.weight.dtype
    assert lazy.lm_head.weight is weight  # the tie survives the conversion
    _assert_same(materialize_module(lazy), eager)
    assert lazy.lm_head.weight is lazy.transformer.wte.weight


def test_conversions_during_construction(swap_on_conversion: Any) -> None:
    torch.manual_seed(0)
    eager = Converted()
    after_eager = torch.rand(4)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = Converted()
    assert torch.equal(torch.rand(4), after_eager)
    assert [p.dtype for p in lazy.parameters()] == [p.dtype for p in eager.parameters()]
    _assert_same(materialize_module(lazy), eager)


def test_build_dtype_from_the_config() -> None:
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel._from_config(config, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = transformers.GPT2LMHeadModel._from_config(config, dtype=torch.bfloat16)
    _assert_same(materialize_module(lazy), eager)


def test_conversion_after_the_context_stays_lazy(swap_on_conversion: Any) -> None:
    torch.manual_seed(0)
    eager = tiny_gpt2(50, 8).to(torch.bfloat16)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = tiny_gpt2(50, 8)
    lazy.to(torch.bfloat16)  # recorded, like an operator inside the context
    assert all(is_lazy(p) and p.dtype == torch.bfloat16 for p in lazy.parameters())
    _assert_same(materialize_module(lazy), eager)


def test_parameter_by_parameter_materialisation_gets_the_converted_dtype() -> None:
    # What the ZeRO-3 wrappers do: materialize_ one parameter at a time, in
    # their own order, with random draws in between.
    torch.manual_seed(0)
    eager = _everything(Converted().to(torch.bfloat16))
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = Converted().to(torch.bfloat16)
    named = dict(lazy.named_parameters())
    names = list(named)
    random.Random(2).shuffle(names)
    for key in names:
        torch.rand(3)
        param = named[key]
        assert materialize_(param) is param
        assert isinstance(param, nn.Parameter)
        assert not is_lazy(param)
        assert param.dtype == torch.bfloat16, key
        assert torch.equal(param, eager[key]), key
        assert dict(lazy.named_parameters())[key] is param


def test_assigning_a_real_value_to_data_materialises() -> None:
    with LazyInitContext():
        layer = nn.Linear(3, 2)
    weight = layer.weight
    value = torch.arange(6.0).reshape(2, 3).to(torch.float16)
    weight.data = value
    assert layer.weight is weight
    assert isinstance(weight, nn.Parameter)
    assert weight.requires_grad
    assert not is_lazy(weight)
    assert not hasattr(weight, "_record")  # the recipe is dropped with it
    assert weight.dtype == torch.float16
    assert weight.data_ptr() == value.data_ptr()  # shared, as .data = does
    assert is_lazy(layer.bias)


def test_chunk_manager_packs_converted_lazy_parameters() -> None:
    """The ZeRO-3 route: the manager materialises each lazy parameter as it
    packs it. Exposed shards are fp32 masters of the bf16 values eager
    construction gives; unexposed chunks keep each parameter's own dtype,
    one chunk per dtype."""
    torch.manual_seed(0)
    eager = _everything(Converted().to(torch.bfloat16))
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = Converted().to(torch.bfloat16)
    ChunkManager(lazy, chunk_size=64, expose_shards=True, compute_dtype=torch.bfloat16)
    for key, param in lazy.named_parameters():
        assert not is_lazy(param), key
        assert param.dtype == torch.float32, key  # the master
        assert torch.equal(param.detach(), eager[key].float().reshape(-1)), key

    torch.manual_seed(0)
    eager = _everything(Converted())
    torch.manual_seed(0)
    with LazyInitContext():
        mixed = Converted()  # bf16, fp16 and fp32 parameters
    manager = ChunkManager(mixed, chunk_size=64)
    assert {c.shard_dtype for c in manager.chunks} == {torch.bfloat16, torch.float16, torch.float32}
    for chunk in manager.chunks:
        chunk.access()  # released after packing: gather to look at the values
    for key, param in mixed.named_parameters():
        assert param.dtype == eager[key].dtype, key
        assert torch.equal(param.detach(), eager[key]), key
