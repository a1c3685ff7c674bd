"""Tiny ``transformers`` models for the tensor-parallel tests: four heads
(eight for Llama, with four key/value heads), so tp 2 and 4 both divide
them, and vocabularies some tp sizes do not divide, to exercise padding."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

MODELS = ("gpt2", "llama", "bert", "opt", "bloom")


_SPECS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        {"vocab_size": 101, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    ),
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 32,
         "tie_word_embeddings": False},
    ),
    "bert": (
        BertConfig,
        BertForMaskedLM,
        {"vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
         "attention_probs_dropout_prob": 0.0},
    ),
    "opt": (
        OPTConfig,
        OPTForCausalLM,
        {"vocab_size": 101, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32, "word_embed_proj_dim": 32,
         "dropout": 0.0, "attention_dropout": 0.0},
    ),
    "bloom": (
        BloomConfig,
        BloomForCausalLM,
        {"vocab_size": 96, "hidden_size": 32, "n_layer": 2, "n_head": 4, "hidden_dropout": 0.0,
         "attention_dropout": 0.0},
    ),
}  # fmt: skip


def build(name: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A tiny model with dropout off (exact parity), built from ``seed``."""
    if name not in _SPECS:
        raise ValueError(f"unknown model {name!r}; one of {MODELS}")
    config_class, model_class, defaults = _SPECS[name]
    torch.manual_seed(seed)
    return model_class(config_class(**{**defaults, **overrides}))


def batch(name: str, step: int, vocab: int, size: int = 2) -> dict[str, torch.Tensor]:
    """Inputs and labels for one step: ``size`` sequences of 8 tokens; BERT masks
    a few positions (-100 elsewhere), the causal models predict every next
    token."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (size, 8), generator=gen)
    ids[:, 1:4] = torch.tensor([0, 1, 3])  # the padding ids of BERT, OPT and Bloom
    if name == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}
