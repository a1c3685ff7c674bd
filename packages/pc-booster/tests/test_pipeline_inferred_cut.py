"""Pipelines for transformers families without a base_model_pp_plan, cut
from their module tree [Note: a cut inferred from the module tree in
pc_booster.pipeline.cut]: OPT's causal LM (its blocks under model.decoder, the
final norm registered before them, the LM head tied to the embedding),
BERT's token classifier, BERT's sequence classifier (its own pooler,
[Note: classifiers that pool their own way]), GPT-2's (the generic head,
taken per position) and ViT's image classifier (pixel_values in, no
inputs_embeds) train in 2 stages as one process does, and evaluate (forward
only) to its loss (fp32, rtol 1e-5 / atol 1e-6, 3 steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    OPTConfig,
    OPTForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

from pc_booster import Booster, HybridParallelPlugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64


def _opt() -> nn.Module:
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = OPTForCausalLM(config)
    return model


def _bert_tokens() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model: nn.Module = BertForTokenClassification(config)
    return model


def _bert_sequences() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model: nn.Module = BertForSequenceClassification(config)
    return model


def _gpt2_sequences() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=32, num_labels=3,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model: nn.Module = GPT2ForSequenceClassification(config)
    return model


def _vit() -> nn.Module:
    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        image_size=8, patch_size=4, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model: nn.Module = ViTForImageClassification(config)
    return model


def _batch(step: int, head: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    if head == "image":
        return {
            "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=gen),
            "labels": torch.randint(0, 3, (BATCH,), generator=gen),
        }
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    labels = {
        "token": lambda: torch.randint(0, 3, (BATCH, SEQ), generator=gen),
        "sequence": lambda: torch.randint(0, 3, (BATCH,), generator=gen),
    }.get(head, lambda: ids)()
    return {"input_ids": ids, "labels": labels}


def check_family_trains(build: Callable[[], nn.Module], head: str) -> None:
    reference = build()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    booster = Booster(plugin=HybridParallelPlugin(pp_size=2, zero_stage=1, num_microbatches=2))
    built = build()
    optimizer: Any = torch.optim.SGD(built.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, *_ = booster.boost(built, optimizer)
    for step in range(STEPS):
        batch = _batch(step, head)
        out = booster.execute_pipeline(iter([batch]), model, None, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        want = reference(**batch).loss
        want.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if booster.plugin.stage_manager.is_last_stage():
            torch.testing.assert_close(out["loss"], want.detach(), rtol=1e-5, atol=1e-6)
    # Evaluation: forward only (no optimizer, no grad), the whole batch's loss
    # on every rank and the logits on the last stage.
    batch = _batch(STEPS, head)
    with torch.no_grad():
        out = booster.execute_pipeline(iter([batch]), model, None, return_outputs=True)
        want = reference(**batch)
    torch.testing.assert_close(out["loss"], want.loss, rtol=1e-5, atol=1e-6)
    if booster.plugin.stage_manager.is_last_stage():
        logits = out["outputs"]["logits"]
        if head != "causal":  # a causal stage's logits are vocabulary-wide, as the model's
            torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    state = booster.plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        if key in state:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


CASES: dict[str, Callable[[], None]] = {
    "opt": lambda: check_family_trains(_opt, "causal"),
    "bert-token": lambda: check_family_trains(_bert_tokens, "token"),
    # BERT pools its first token through its own pooler: the last stage runs it.
    "bert-sequence": lambda: check_family_trains(_bert_sequences, "sequence"),
    # GPT-2 pools as transformers' generic head does (the last token that is
    # not padding): its score is taken per position and the loss pools.
    "gpt2-sequence": lambda: check_family_trains(_gpt2_sequences, "sequence"),
    # ViT's forward takes pixel_values and no inputs_embeds: its blocks are
    # passed the hidden states alone, its last stage runs its own layernorm,
    # first-token pooling and classifier [Note: blocks passed nothing but
    # the hidden states].
    "vit-image": lambda: check_family_trains(_vit, "image"),
}


def run(case: str) -> None:
    CASES[case]()


def test_families_without_a_plan_cut_from_their_module_tree() -> None:
    run_subtests(run, 2, {"case": list(CASES)}, timeout=240)
