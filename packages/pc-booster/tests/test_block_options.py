"""Per-block recomputation applied twice to one model (a second boost of
it, after a refusal or under another booster) is applied once: torch's
composable ``checkpoint`` refused a second application with an
AssertionError, and the ``use_cache=False`` hook was registered again."""

from __future__ import annotations

import pytest
import torch

from pc_booster import DDPOptions
from pc_booster.plugins.optimizations import apply_block_options, transformer_blocks

transformers = pytest.importorskip("transformers")


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def test_recomputation_applied_twice_is_applied_once() -> None:
    model = _model()
    options = DDPOptions(activation_checkpointing="full")
    apply_block_options(model, options)
    hooks = len(model._forward_pre_hooks)
    apply_block_options(model, options)  # raised AssertionError before
    assert len(model._forward_pre_hooks) == hooks
    calls = [0]
    first = transformer_blocks(model)[0]
    activation = first.get_submodule("mlp.act_fn")  # a plain call, counted again on recompute
    activation.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2  # forward, then once recomputed in backward: not twice
