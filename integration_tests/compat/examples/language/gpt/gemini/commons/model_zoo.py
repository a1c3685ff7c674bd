# Ported from Colossal-AI examples/language/gpt/gemini/commons/model_zoo.py at commit
# 4f9953be335ef371b3848719ddafe596c01ecd37 by the import rule
# (colossalai -> pc_compat.colossalai). Changed beyond it, by original line:
# - 18-25 GPT2Config(...): resid/embd/attn_pdrop=0.0 added (dropout draws differ across ranks).
# - 35-36 gpt2_medium: hidden 32, 2 layers, 2 heads, 32 positions, vocabulary 64 (tiny).
# Layout: ruff format and ruff's behaviour-preserving fixes (import order, List -> list,
# Optional[X] -> X | None, elif/else after return, str.format -> f-string).
# mypy: ignore-errors
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel


## Define the Model and Loss Based on Huggingface transformers GPT2LMHeadModel
class GPTLMModel(nn.Module):
    def __init__(
        self,
        hidden_size=768,
        num_layers=12,
        num_attention_heads=12,
        max_seq_len=1024,
        vocab_size=50257,
        checkpoint=False,
    ):
        super().__init__()
        self.checkpoint = checkpoint
        self.config = GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_attention_heads,
            n_positions=max_seq_len,
            n_ctx=max_seq_len,
            vocab_size=vocab_size,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(self.config)
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        # Only return lm_logits
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint
        )[0]


def gpt2_medium(checkpoint=False):
    return GPTLMModel(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        max_seq_len=32,
        vocab_size=64,
        checkpoint=checkpoint,
    )


def gpt2_xl(checkpoint=True):
    return GPTLMModel(
        hidden_size=1600, num_layers=48, num_attention_heads=32, checkpoint=checkpoint
    )


def gpt2_10b(checkpoint=True):
    return GPTLMModel(
        hidden_size=4096, num_layers=50, num_attention_heads=16, checkpoint=checkpoint
    )


def gpt2_14b(checkpoint=True):
    return GPTLMModel(
        hidden_size=4096, num_layers=70, num_attention_heads=16, checkpoint=checkpoint
    )


def gpt2_20b(checkpoint=True):
    return GPTLMModel(
        hidden_size=8192, num_layers=25, num_attention_heads=16, checkpoint=checkpoint
    )


def gpt2_24b(checkpoint=True):
    return GPTLMModel(
        hidden_size=8192, num_layers=30, num_attention_heads=16, checkpoint=checkpoint
    )


def gpt2_30b(checkpoint=True):
    return GPTLMModel(
        hidden_size=8192, num_layers=37, num_attention_heads=16, checkpoint=checkpoint
    )


def gpt2_40b(checkpoint=True):
    return GPTLMModel(
        hidden_size=8192, num_layers=50, num_attention_heads=16, checkpoint=checkpoint
    )


def model_builder(model_size: str) -> callable:
    if model_size == "gpt2_medium":
        return gpt2_medium
    if model_size == "gpt2_xl":
        return gpt2_xl
    if model_size == "gpt2_10b":
        return gpt2_10b
    if model_size == "gpt2_14b":
        return gpt2_14b
    if model_size == "gpt2_20b":
        return gpt2_20b
    if model_size == "gpt2_24b":
        return gpt2_24b
    if model_size == "gpt2_30b":
        return gpt2_30b
    if model_size == "gpt2_40b":
        return gpt2_40b
    raise TypeError(f"model_builder {model_size}")


__all__ = ["model_builder"]
