"""A ``transformers`` model as a sequence of pipeline layers, for the hybrid
plugin: the embedding, each transformer block, and the head, each taking
the previous one's output (token ids, then hidden states, then logits).

Blocks run without an attention mask: causal models get their causal mask
from the attention itself (``is_causal``), BERT attends everywhere, as the
whole model does for unpadded batches. Padding masks are not carried
through the pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SUPPORTED", "pipeline_layers"]

SUPPORTED = ("gpt2", "llama", "bert")


class _GPT2Embed(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = lm.transformer.wte, lm.transformer.wpe, lm.transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(positions))
        return out


class _Block(nn.Module):
    """A transformer block called on the hidden states alone."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # Llama: position embeddings computed per stage

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.rotary is not None:
            positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
        out = self.block(hidden, **kwargs)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


class _Head(nn.Module):
    def __init__(self, norm: nn.Module | None, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(hidden) if self.norm is not None else hidden)
        return out


class _BertEmbed(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.embeddings = lm.bert.embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embeddings(input_ids=ids)
        return out


def pipeline_layers(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The layers of ``model`` in order, and its loss kind (``"causal"`` or
    ``"masked"``). Supported: ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
    ``BertForMaskedLM``."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    lm: Any = model
    if kind == "gpt2" and name == "GPT2LMHeadModel":
        blocks = [_Block(b) for b in lm.transformer.h]
        return [_GPT2Embed(lm), *blocks, _Head(lm.transformer.ln_f, lm.lm_head)], "causal"
    if kind == "llama" and name == "LlamaForCausalLM":
        rotary = lm.model.rotary_emb
        blocks = [_Block(b, rotary) for b in lm.model.layers]
        return [lm.model.embed_tokens, *blocks, _Head(lm.model.norm, lm.lm_head)], "causal"
    if kind == "bert" and name == "BertForMaskedLM":
        blocks = [_Block(b) for b in lm.bert.encoder.layer]
        return [_BertEmbed(lm), *blocks, _Head(None, lm.cls)], "masked"
    raise ValueError(
        f"pipeline parallelism in HybridParallelPlugin splits GPT2LMHeadModel, "
        f"LlamaForCausalLM and BertForMaskedLM; got {name} (model_type={kind!r}). For "
        "another model, build the stages yourself with pc_pipeline (partition a Sequential)."
    )
