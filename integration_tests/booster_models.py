"""Tiny ``transformers`` GPT-2, Llama and BERT for the booster tests, with
dropout off (exact parity) and four heads, so tp 2 divides them."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

MODELS = ("gpt2", "llama", "bert")


def build(name: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    if name == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )
        )  # fmt: skip
    if name == "llama":
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            )
        )  # fmt: skip
    if name == "bert":
        return BertForMaskedLM(
            BertConfig(
                vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )  # fmt: skip
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")


def batch(name: str, step: int, size: int) -> dict[str, torch.Tensor]:
    """``size`` sequences of 8 tokens. Every sequence has the same number
    of targets (BERT masks every third position), so the mean of the
    data-parallel ranks' mean losses is the global batch's mean loss."""
    gen = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, 96, (size, 8), generator=gen)
    ids[:, 1:4] = torch.tensor([0, 1, 3])  # the padding ids of BERT, OPT and Bloom
    if name == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}
