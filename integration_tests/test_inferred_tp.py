"""ViT, a family with neither a tensor-parallel plan in its config nor a pc
policy, trained as Colossal-AI's examples train it: through the Booster
with ``HybridParallelPlugin(tp_size=2, precision="fp32")`` and
``model(pixel_values=..., labels=...)``, sharded by the plan
``pc_tensor.infer_plan`` reads from its module tree; 3 SGD steps against
single-process training of the same model on the same batch (world 2: dp 1
x tp 2)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import ViTConfig, ViTForImageClassification

from pc_booster import Booster, HybridParallelPlugin
from pc_comm.testing import run_subtests
from pc_tensor import shard_info

pytestmark = pytest.mark.timeout(300)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check_vit_trains_under_hybrid_tp(precision: str) -> None:
    torch.manual_seed(0)
    ref = ViTForImageClassification(
        ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=8, patch_size=4, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager",
        )
    )  # fmt: skip
    copied = copy.deepcopy(ref)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, precision=precision))
    model, optimizer, *_ = booster.boost(copied, torch.optim.SGD(copied.parameters(), lr=0.1))
    assert shard_info(copied).policy == "vit (inferred)"
    assert copied.vit.layers[0].attention.num_attention_heads == 2
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    batch = {
        "pixel_values": torch.randn(2, 3, 8, 8, generator=gen),
        "labels": torch.randint(0, 3, (2,), generator=gen),
    }
    for step in range(3):
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        expected = ref(**batch).loss
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _close(loss.detach(), expected.detach(), f"step {step} loss")
    assert dist.get_world_size(booster.plugin.dp_group) == 1
    state = booster.plugin.model_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(state[key], value, key)


def test_vit_trains_under_hybrid_parallel_plugin_tp2() -> None:
    run_subtests(check_vit_trains_under_hybrid_tp, 2, {"precision": ["fp32"]}, timeout=240)
