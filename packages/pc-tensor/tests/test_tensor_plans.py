"""Policies read from transformers' tensor-parallel plans
(``config.base_model_tp_plan``): the plan of a family pc had a hand-written
policy for (Llama) gives that policy's Megatron layout; the styles map as
documented; what pc cannot follow is refused with the key and the reason.
Parity of the plan-derived sharding with single-process training is the
plan sweep's (integration_tests/plans)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pc_tensor import POLICIES, plan_policy, policy_for  # noqa: E402

TINY = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip


def _build(config: object, cls: object) -> torch.nn.Module:
    with torch.device("meta"):
        model: torch.nn.Module = cls(config)  # type: ignore[operator]
    return model


def test_llama_plan_gives_the_megatron_layout_pc_wrote_by_hand() -> None:
    """Llama had a hand-written policy until its plan replaced it: the plan
    must say what that policy said (column q/k/v/gate/up, row o/down, the
    whole sequence gathered at attention and the gated MLP, head counts
    checked, the LM head split by vocabulary with the causal loss)."""
    model = _build(transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM)
    policy = plan_policy(model)
    assert policy_for(model) == policy
    assert "llama" not in POLICIES  # one source for the layout
    assert policy.blocks == "layers"
    assert policy.embedding == "embed_tokens"
    assert dict(policy.column) == {
        "self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1,
        "mlp.gate_proj": 1, "mlp.up_proj": 1,
    }  # fmt: skip
    assert set(policy.row) == {"self_attn.o_proj", "mlp.down_proj"}
    assert set(policy.gather_at) == {"self_attn", "mlp"}
    assert {"num_attention_heads", "num_key_value_heads"} <= set(policy.head_counts)
    assert dict(policy.lm_heads) == {"LlamaForCausalLM": "lm_head"}
    assert policy.loss == "causal"
    assert policy.gather_output == policy.split_input == policy.grad_sum == ()


def test_plan_styles_map_to_the_policy() -> None:
    phi3 = plan_policy(_build(transformers.Phi3Config(**TINY), transformers.Phi3ForCausalLM))
    assert set(phi3.gather_output) == {"self_attn.qkv_proj", "mlp.gate_up_proj"}
    assert set(phi3.split_input) == {"self_attn.o_proj", "mlp.down_proj"}
    qwen3 = plan_policy(_build(transformers.Qwen3Config(**TINY), transformers.Qwen3ForCausalLM))
    assert set(qwen3.grad_sum) == {"self_attn.q_norm", "self_attn.k_norm"}
    # A head that is not an LM head stays whole on every rank.
    classifier = _build(
        transformers.Qwen2Config(**TINY, num_labels=3),
        transformers.Qwen2ForSequenceClassification,
    )
    assert dict(plan_policy(classifier).lm_heads) == {}


def test_what_pc_cannot_follow_is_refused_with_the_reason() -> None:
    mixtral = _build(
        transformers.MixtralConfig(**TINY, num_local_experts=2), transformers.MixtralForCausalLM
    )
    with pytest.raises(ValueError, match=r"mixture-of-experts blocks \('layers.\*.mlp'"):
        plan_policy(mixtral)
    gpt2 = _build(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4), transformers.GPT2LMHeadModel
    )
    assert policy_for(gpt2) is POLICIES["gpt2"]  # no plan: pc's own policy
    with pytest.raises(ValueError, match=r"has no tensor-parallel plan"):
        plan_policy(gpt2)
