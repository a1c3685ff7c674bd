"""Tensor parallelism for ``transformers`` families with neither a plan in
their config nor a pc policy, from the plan :func:`pc_tensor.infer_plan`
reads from the module tree: ViT (as Colossal-AI's examples train it),
DeiT, Dinov2 (with its gated MLP), CLIP's vision tower and RoBERTa, at tp
2, trained 3 SGD steps against single-process training of the same model
on the same batch (losses and every gathered parameter); DeiT and RoBERTa
under sequence parallelism too. Models off the pattern are refused with
the reason. (Booster's HybridParallelPlugin on ViT:
integration_tests/test_inferred_tp.py.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

transformers = pytest.importorskip("transformers")

from pc_comm.testing import run_subtests  # noqa: E402
from pc_tensor import (  # noqa: E402
    POLICIES,
    full_state_dict,
    infer_plan,
    plan_policy,
    policy_or_inferred,
    shard_info,
    shard_model,
)

pytestmark = pytest.mark.timeout(600)

VISION = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "image_size": 8, "patch_size": 4, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager",
}  # fmt: skip
TEXT = {
    "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager",
}  # fmt: skip
CLIP_VISION = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
    "image_size": 8, "patch_size": 4, "attn_implementation": "eager",
}  # fmt: skip

# family -> (model from a config, the batch, the loss from the outputs)
_Family = tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]], str]


def _pixels(labels: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    batch = {"pixel_values": torch.randn(2, 3, 8, 8, generator=gen)}
    if labels:
        batch["labels"] = torch.randint(0, 3, (2,), generator=gen)
    return batch


def _tokens() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 50, (2, 8), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, 3, (2,), generator=gen)}


FAMILIES: dict[str, _Family] = {
    "vit": (
        lambda: transformers.ViTForImageClassification(
            transformers.ViTConfig(**VISION, num_labels=3)
        ),
        _pixels,
        "loss",
    ),
    "deit": (
        lambda: transformers.DeiTForImageClassification(
            transformers.DeiTConfig(**VISION, num_labels=3)
        ),
        _pixels,
        "loss",
    ),
    "dinov2": (
        lambda: transformers.Dinov2ForImageClassification(
            transformers.Dinov2Config(
                **VISION, num_labels=3, drop_path_rate=0.0, use_swiglu_ffn=True
            )
        ),
        _pixels,
        "loss",
    ),
    "clip_vision": (
        lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**CLIP_VISION)),
        lambda: _pixels(labels=False),
        "pooler_output",
    ),
    "roberta": (
        lambda: transformers.RobertaForSequenceClassification(
            transformers.RobertaConfig(**TEXT, num_labels=3)
        ),
        _tokens,
        "loss",
    ),
}


# Families whose sequence tp divides (DeiT's 4 patches and 2 tokens,
# RoBERTa's 8 tokens), also trained under sequence parallelism.
SEQUENCE_PARALLEL = ("deit", "roberta")

# Each family's attention module (in a block) and the attributes that count
# its heads or width, whole: each rank must hold 1/tp of each.
HEADS: dict[str, tuple[str, dict[str, int]]] = {
    "vit": ("attention", {"num_attention_heads": 4}),
    "deit": ("attention", {"num_attention_heads": 4}),
    "dinov2": ("attention", {"num_attention_heads": 4}),
    "clip_vision": ("self_attn", {"embed_dim": 32, "num_heads": 4}),
    "roberta": ("attention.self", {"num_attention_heads": 4, "all_head_size": 32}),
}


def _build(family: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = FAMILIES[family][0]()
    # DeiT starts its class, distillation and position tokens at zero: the
    # first LayerNorm then sees near-constant rows and their gradients reach
    # 1e4, so one SGD step turns rounding into a difference past tolerance.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_token", "position_embeddings")) and not param.any():
                param.normal_(std=0.02)
    return model


def _loss(family: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out: Any = model(**batch)
    value: torch.Tensor = out[FAMILIES[family][2]]
    return value if value.dim() == 0 else value.square().mean()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check_family_matches_single_process(family: str, sequence_parallel: bool) -> None:
    tp = dist.get_world_size()
    ref = _build(family)
    policy = infer_plan(ref, tp_size=tp)
    assert not getattr(ref.config, "base_model_tp_plan", None)  # no plan: inferred
    assert ref.config.model_type not in POLICIES
    model = shard_model(copy.deepcopy(ref), sequence_parallel=sequence_parallel)
    info = shard_info(model)
    assert info.policy == policy.name
    assert policy.name.endswith("(inferred)")
    assert info.vocab_size == 0  # no token embedding split (RoBERTa's stays whole)
    # The four projections' weights split in every block, and the column
    # ones' biases; each attention holds its share of the heads.
    base = next(n for n, m in ref.named_modules() if m is ref.base_model)
    prefix = f"{base}.{policy.blocks}." if base else f"{policy.blocks}."
    split = {
        name
        for name, _ in ref.named_parameters()
        if name.startswith(prefix)
        and any(
            name.endswith(f".{path}.weight")
            or (path in policy.column and name.endswith(f".{path}.bias"))
            for path in (*policy.column, *policy.row)
        )
    }
    assert set(info.sharded) == split
    assert len(split) >= 12
    attention, counts = HEADS[family]
    assert dict(policy.heads) == {attention: tuple(counts)}
    for block in model.base_model.get_submodule(policy.blocks):
        mine = block.get_submodule(attention)
        assert {name: getattr(mine, name) * tp for name in counts} == counts
    batch = FAMILIES[family][1]()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        expected, loss = _loss(family, ref, batch), _loss(family, model, batch)
        _close(loss, expected, f"{family} step {step} loss")
        torch.autograd.backward([expected, loss])
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        state = full_state_dict(model)
        for key, value in ref.state_dict().items():
            _close(state[key], value, f"{family} step {step} {key}")


def check_refused_at_shard_time() -> None:
    """tp must divide the heads; the plan or pc policy a family has wins."""
    config = transformers.ViTConfig(**{**VISION, "hidden_size": 24, "num_attention_heads": 3})
    with pytest.raises(ValueError, match=r"num_attention_heads = 3 is not divisible by the tensor"):
        shard_model(transformers.ViTModel(config))
    with pytest.raises(ValueError, match=r"no hand-written policy for it .* infers one from its"):
        shard_model(transformers.DistilBertModel(transformers.DistilBertConfig(
            vocab_size=50, dim=32, n_layers=2, n_heads=4, hidden_dim=64)))  # fmt: skip


def check_all(case: str, sequence_parallel: bool) -> None:
    if case in FAMILIES and (case in SEQUENCE_PARALLEL or not sequence_parallel):
        check_family_matches_single_process(case, sequence_parallel)
    elif case == "refusals" and not sequence_parallel:
        check_refused_at_shard_time()


def test_inferred_plan_trains_like_single_process() -> None:
    run_subtests(
        check_all,
        2,
        {"case": [*FAMILIES, "refusals"], "sequence_parallel": [False, True]},
        timeout=400,
    )


# Refusals: pure logic, no process group.


def _refused(model: nn.Module, match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        infer_plan(model, tp_size=2)
    assert "Fix:" in str(error.value)


def test_inferred_plan_for_vit_is_the_megatron_layout() -> None:
    vit = _build("vit")
    policy = infer_plan(vit)
    assert policy.blocks == "layers"
    assert policy.embedding == ""
    assert dict(policy.column) == dict.fromkeys(
        ["attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"], 1
    )
    assert policy.row == ("attention.o_proj", "mlp.fc2")
    assert dict(policy.heads) == {"attention": ("num_attention_heads",)}
    assert policy.head_counts == ("num_attention_heads",)
    assert set(policy.gather_at) == {"attention", "mlp"}
    roberta = infer_plan(_build("roberta"))
    assert roberta.row == ("attention.output.dense", "output.dense")
    assert dict(roberta.heads) == {"attention.self": ("num_attention_heads", "all_head_size")}
    assert policy_or_inferred(vit) == policy
    # A config plan or a pc policy comes first.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4))
    assert policy_or_inferred(gpt2) is POLICIES["gpt2"]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    assert policy_or_inferred(llama) == plan_policy(llama)


def test_models_off_the_pattern_are_refused() -> None:
    swin = transformers.SwinModel(transformers.SwinConfig(
        embed_dim=16, depths=[1, 1], num_heads=[2, 4], image_size=8, patch_size=2,
        window_size=2))  # fmt: skip
    _refused(swin, r"3 such block lists \(encoder.layers, encoder.layers.0.blocks, encoder")
    whisper = transformers.WhisperModel(transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, vocab_size=60, num_mel_bins=8, max_source_positions=8,
        max_target_positions=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1))  # fmt: skip
    _refused(whisper, r"2 such block lists \(encoder.layers, decoder.layers\)")
    distilbert = transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=4, hidden_dim=64))  # fmt: skip
    _refused(distilbert, r"no nn.ModuleList of blocks holds projections named q_proj")
    # BEiT fits without relative-position biases, whose tables hold a value per head.
    beit = {**VISION, "drop_path_rate": 0.0}
    assert infer_plan(transformers.BeitModel(transformers.BeitConfig(**beit))).blocks == "layers"
    per_layer = transformers.BeitConfig(**beit, use_relative_position_bias=True)
    _refused(
        transformers.BeitModel(per_layer),
        r"layers.0.relative_position_bias.relative_position_bias_table \(12, 4\) holds a value "
        r"per attention head",
    )
    shared = transformers.BeitConfig(**beit, use_shared_relative_position_bias=True)
    _refused(transformers.BeitModel(shared), r"shared_position_bias.* per attention head")
    # BigBird swaps its attention for one built from the config (whole head
    # count) when a sequence is too short for block-sparse attention.
    big_bird = transformers.BigBirdModel(transformers.BigBirdConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64))  # fmt: skip
    _refused(big_bird, r"encoder.layer.0 \(BigBirdLayer\) has set_attention_type\(\), by which")


class _LoRALinear(nn.Linear):
    """A projection that is not plain ``nn.Linear``: its forward may do
    anything, so it is not split."""


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o_proj = nn.Linear(32, 96), nn.Linear(32, 32)
        self.num_heads = 4


class _FusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Fused()
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(32, 64), "fc2": nn.Linear(64, 32)})


def test_blocks_off_the_pattern_are_refused() -> None:
    vit = _build("vit")
    vit.vit.layers[1].mlp.fc1 = nn.Linear(32, 128)
    _refused(vit, r"layers.1 differs from layers.0")
    vit = _build("vit")
    for layer in vit.vit.layers:
        old = layer.attention.q_proj
        layer.attention.q_proj = _LoRALinear(old.in_features, old.out_features)
    _refused(vit, r"layers.0.attention.q_proj is _LoRALinear, not nn.Linear")
    vit = _build("vit")
    for layer in vit.vit.layers:
        layer.attention.q_norm = nn.LayerNorm(8)
    _refused(vit, r"layers.0.attention.q_norm \(LayerNorm\) holds parameters inside")
    vit = _build("vit")
    for layer in vit.vit.layers:
        del layer.attention.o_proj
    _refused(vit, r"the attention layers.0.attention has no output projection")
    vit = _build("vit")
    for layer in vit.vit.layers:
        del layer.mlp.fc2
    _refused(vit, r"up projections \['mlp.fc1'\] and down projections none")
    vit = _build("vit")
    for layer in vit.vit.layers:
        layer.attention.num_attention_heads = 3
        layer.attention.head_dim = 11  # counts nothing the config or the projections say
    _refused(vit, r"has no integer attribute counting its heads")
    vit = _build("vit")
    vit.vit.layers[0].attention.num_attention_heads = 3
    vit.vit.layers[1].attention.num_attention_heads = 3
    vit.config.num_attention_heads = 3
    _refused(vit, r"attention.num_attention_heads = 3 is not divisible by the tensor-parallel")
    fused = nn.Module()
    fused.layers = nn.ModuleList(_FusedBlock() for _ in range(2))
    _refused(fused, r"layers.0.attn.qkv is a fused query/key/value projection")
