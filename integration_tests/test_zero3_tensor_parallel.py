"""ZeRO-3 over tensor parallelism (issue 43): TorchFSDPPlugin(tp_size=2) and
GeminiPlugin(tp_size=2) at world 4 split each block's projections over
pairs of consecutive ranks (torch's DTensor styles from the model's
base_model_tp_plan [Note: FSDP2 over tensor parallelism] in
pc_booster.plugins.fsdp_tp; pc-tensor's split for Gemini) and shard
everything over the two pairs (FSDP2; Gemini's chunks of each rank's
pieces, the norm spanning the tp ranks). Against single-process training of the same
model on the same global batch (each data-parallel pair a half): losses
and every parameter at rtol 1e-5 / atol 1e-6 over 4 steps (AdamW: atol
1e-5), SGD and AdamW, with clipping by the global norm (norms over the
(dp, tp) and dp meshes combined), Llama and Qwen2 (biased projections).
The split is checked to happen. A sharded checkpoint of each continues at
rtol 1e-5 under the other, under tp_size=1 and under ZeRO-2; Gemini's
full (one-file) model and optimizer too. One spawn runs every case."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchFSDPPlugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH, SEQ, VOCAB = 4, 8, 8, 97
CLIP = 0.5


def _model(family: str) -> nn.Module:
    import transformers

    shape = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32,
    }  # fmt: skip
    config: Any = (
        transformers.LlamaConfig(**shape)
        if family == "llama"
        else transformers.Qwen2Config(**shape, use_sliding_window=False)
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    # Adam's step divides by the gradient's own size: an element whose
    # gradient is near zero moves by up to lr on rounding alone (the tp
    # ranks sum partial products in another order), so lr bounds the error.
    return torch.optim.AdamW(params, lr=1e-3)


def _reference(family: str, kind: str, clip: float) -> tuple[nn.Module, list[float]]:
    model = _model(family)
    opt = _optimizer(kind, model.parameters())
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip:
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"the clip at {clip} is not exercised (norm {norm})"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _boosted(plugin: Plugin, family: str, kind: str) -> tuple[Booster, Any, Any]:
    booster = Booster(plugin=plugin)
    model = _model(family)
    model, opt, *_ = booster.boost(model, _optimizer(kind, model.parameters()))
    return booster, model, opt


def _train(booster: Booster, model: Any, opt: Any, steps: range) -> list[float]:
    plugin = booster.plugin
    part, parts = dist.get_rank(plugin.dp_group), plugin.dp_size
    losses = []
    for step in steps:
        ids = _batch(step).chunk(parts)[part]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=plugin.dp_group)
        losses.append(whole.item() / parts)
    return losses


def _tp_plugin(kind: str, clip: float = 0.0) -> Plugin:
    if kind == "gemini":
        return GeminiPlugin(tp_size=2, max_norm=clip, chunk_size=4096)
    return TorchFSDPPlugin(tp_size=2, max_norm=clip)


def _check_split(plugin: Plugin, model: Any) -> None:
    """The projections are split over tp (the checks fail without it)."""
    assert (plugin.dp_size, plugin.tp_size) == (2, 2)
    if isinstance(plugin, GeminiPlugin):
        from pc_tensor import shard_info

        info = shard_info(plugin.boosted(model).module)
        assert "model.layers.0.self_attn.q_proj.weight" in info.sharded, info.sharded
        return
    from torch.distributed.tensor import DTensor

    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor), q_proj
    assert q_proj.device_mesh.ndim == 2, q_proj
    assert q_proj.to_local().shape[0] == 32 // 4, q_proj.to_local().shape  # split by 2 x 2


def check_parity(plugin_kind: str, family: str, kind: str, clip: float) -> None:
    rtol, atol = (1e-5, 1e-6) if kind == "sgd" else (1e-5, 1e-5)
    reference, want = _reference(family, kind, clip)
    plugin = _tp_plugin(plugin_kind, clip)
    booster, model, opt = _boosted(plugin, family, kind)
    _check_split(plugin, model)
    got = _train(booster, model, opt, range(STEPS))
    assert got == pytest.approx(want, rel=rtol, abs=atol), (got, want)
    state = plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        close = torch.isclose(state[key], value, rtol=rtol, atol=atol)
        worst = float((state[key] - value).abs().max())
        assert bool(close.all()), f"{key}: {int((~close).sum())} elements differ, by {worst}"


def check_checkpoint(root: str, plugin_kind: str) -> None:
    where = Path(root) / f"{plugin_kind}-tp2"
    booster, model, opt = _boosted(_tp_plugin(plugin_kind), "llama", "adamw")
    _train(booster, model, opt, range(2))
    booster.save_model(model, where / "model", shard=True)
    booster.save_optimizer(opt, where / "optim", shard=True)
    if plugin_kind == "gemini":  # the one-file forms too
        booster.save_model(model, where / "model.pt")
        booster.save_optimizer(opt, where / "optim.pt")
    want = _train(booster, model, opt, range(2, STEPS))
    others = [TorchFSDPPlugin(), LowLevelZeroPlugin(stage=2), *map(_tp_plugin, ("fsdp", "gemini"))]
    for other in others:
        booster, model, opt = _boosted(copy.copy(other), "llama", "adamw")
        booster.load_model(model, where / "model")
        booster.load_optimizer(opt, where / "optim")
        got = _train(booster, model, opt, range(2, STEPS))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (other, got, want)
    if plugin_kind == "gemini":
        booster, model, opt = _boosted(_tp_plugin("gemini"), "llama", "adamw")
        booster.load_model(model, where / "model.pt")
        booster.load_optimizer(opt, where / "optim.pt")
        got = _train(booster, model, opt, range(2, STEPS))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), ("one file", got, want)


def check_case(root: str, case: str) -> None:
    plugin_kind, rest = case.split(":")
    if rest == "checkpoint":
        check_checkpoint(root, plugin_kind)
        return
    family, kind, *clip = rest.split("-")
    check_parity(plugin_kind, family, kind, CLIP if clip else 0.0)


CASES = [
    f"{plugin}:{case}"
    for plugin in ("fsdp", "gemini")
    for case in ("llama-sgd", "llama-adamw-clip", "qwen2-sgd-clip", "checkpoint")
]


def test_zero3_over_tensor_parallel_matches_single_process(tmp_path: Path) -> None:
    run_subtests(check_case, 4, {"case": CASES}, args=(str(tmp_path),), timeout=280)


def test_tp_size_rules() -> None:
    from pc_booster.plugins.torch_fsdp import TorchFSDPOptions
    from pc_booster.rules import RunSetting

    with pytest.raises(ValueError, match="tp_size=3 must divide the 4 ranks"):
        TorchFSDPOptions(tp_size=3).validate(RunSetting(world=4))
    with pytest.raises(ValueError, match="hybrid sharding over tensor-parallel shards"):
        TorchFSDPOptions(tp_size=2, sharding_strategy="HYBRID_SHARD").validate(RunSetting())


def test_a_model_without_a_plan_is_refused_with_the_alternative() -> None:
    from pc_booster.plugins.fsdp_tp import tensor_parallel_plan

    with pytest.raises(ValueError, match=r"has none\. Use HybridParallelPlugin"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 4)), 2)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by 3"):
        tensor_parallel_plan(_model("llama"), 3)
