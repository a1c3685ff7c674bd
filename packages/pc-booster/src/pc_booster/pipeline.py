"""A ``transformers`` model as a sequence of pipeline layers, for the hybrid
plugin: the embedding, each transformer block, and the head, each taking
the previous one's output (token ids, then hidden states, then logits).

Causal models get their causal mask from the attention itself under
``sdpa`` and FlashAttention (``is_causal`` when no mask is given); under
``eager`` attention, which applies only the mask it is given, every block
gets an explicit causal mask. BERT attends everywhere, as the whole model
does for unpadded batches. Padding masks are not carried through the
pipeline.
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


_CAUSAL_ITSELF = ("sdpa", "flash_attention_2", "flash_attention_3")


def _needs_causal_mask(model: nn.Module) -> bool:
    """Whether the blocks' attention must be given the causal mask."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl in _CAUSAL_ITSELF:
        return False
    if impl == "eager":
        return True
    raise ValueError(
        f"pipeline parallelism runs the blocks under the {impl!r} attention "
        f"implementation, which it cannot give a causal mask; use one of "
        f"{', '.join(map(repr, (*_CAUSAL_ITSELF, 'eager')))} "
        "(model.set_attn_implementation('sdpa'))."
    )


class _Block(nn.Module):
    """A transformer block called on the hidden states alone."""

    def __init__(
        self, block: nn.Module, rotary: nn.Module | None = None, causal_mask: bool = False
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # Llama: position embeddings computed per stage
        self.causal_mask = causal_mask  # eager attention: the mask is given, not implied

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.causal_mask:
            length = hidden.shape[1]
            blocked = torch.full(
                (length, length), torch.finfo(hidden.dtype).min, dtype=hidden.dtype,
                device=hidden.device,
            )  # fmt: skip
            kwargs["attention_mask"] = blocked.triu(1)[None, None]
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
        causal = _needs_causal_mask(model)
        blocks = [_Block(b, causal_mask=causal) for b in lm.transformer.h]
        return [_GPT2Embed(lm), *blocks, _Head(lm.transformer.ln_f, lm.lm_head)], "causal"
    if kind == "llama" and name == "LlamaForCausalLM":
        rotary, causal = lm.model.rotary_emb, _needs_causal_mask(model)
        blocks = [_Block(b, rotary, causal) for b in lm.model.layers]
        return [lm.model.embed_tokens, *blocks, _Head(lm.model.norm, lm.lm_head)], "causal"
    if kind == "bert" and name == "BertForMaskedLM":
        blocks = [_Block(b) for b in lm.bert.encoder.layer]
        return [_BertEmbed(lm), *blocks, _Head(None, lm.cls)], "masked"
    raise ValueError(
        f"pipeline parallelism in HybridParallelPlugin splits GPT2LMHeadModel, "
        f"LlamaForCausalLM and BertForMaskedLM; got {name} (model_type={kind!r}). For "
        "another model, build the stages yourself with pc_pipeline (partition a Sequential)."
    )
