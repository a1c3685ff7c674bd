"""Colossal-AI's HybridParallelPlugin arguments, as its programs pass them:
each accepted one does what it says (checked so that ignoring it fails),
training still matches single-process training, and each refused one says
why and what pc does instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from pc_booster import Booster
from pc_booster.plugin import HybridParallelPlugin
from pc_booster.plugins.hybrid import _fused_rms_norm
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _ids(step: int, size: int = 4) -> torch.Tensor:
    return torch.randint(0, 96, (size, 8), generator=torch.Generator().manual_seed(200 + step))


def _reference(build: Any, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        ids = _ids(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def _train(plugin: HybridParallelPlugin, build: Any, steps: int) -> tuple[list[float], Any, Any]:
    booster = Booster(plugin=plugin)
    built = build()
    model, optimizer, *_ = booster.boost(
        built, torch.optim.SGD(built.parameters(), lr=0.1, momentum=0.9)
    )
    losses = []
    for step in range(steps):
        ids = _ids(step)
        if plugin.pp_size > 1:
            out = booster.execute_pipeline(
                iter([{"input_ids": ids, "labels": ids}]), model, None, optimizer
            )
            loss = out["loss"]
        else:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, booster, model


def _matches(build: Any, losses: list[float], booster: Booster, model: Any) -> None:
    want_losses, want_state = _reference(build, len(losses))
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    state = booster.plugin.model_state_dict(model)
    for key, value in want_state.items():
        if key in state:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5)


def check_accepted(case: str) -> None:
    if case == "microbatch_size":
        plugin = HybridParallelPlugin(pp_size=2, zero_stage=1, microbatch_size=1)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.chunks == 4  # 4 rows, micro-batches of 1
        _matches(_gpt2, losses, booster, model)
    elif case == "num_model_chunks":
        plugin = HybridParallelPlugin(pp_size=2, pp_style="interleaved", num_model_chunks=2,
                                      zero_stage=1, num_microbatches=2)  # fmt: skip
        assert plugin.stage_manager is not None
        assert plugin.stage_manager.is_interleave
        losses, booster, model = _train(plugin, _llama_four_layers, 3)
        _matches(_llama_four_layers, losses, booster, model)
    elif case == "split_gather":
        plugin = HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True,
                                      sequence_parallelism_mode="split_gather")  # fmt: skip
        losses, booster, model = _train(plugin, _gpt2, 3)
        _matches(_gpt2, losses, booster, model)
    elif case == "flash_attention":
        plugin = HybridParallelPlugin(tp_size=2, enable_flash_attention=True)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.unwrap().config._attn_implementation == "sdpa"
        _matches(_gpt2, losses, booster, model)
    elif case == "fused_normalization":
        plugin = HybridParallelPlugin(tp_size=2, enable_fused_normalization=True)
        losses, booster, model = _train(plugin, _llama, 3)
        norms = [m for m in model.unwrap().modules() if type(m).__name__ == "LlamaRMSNorm"]
        assert norms
        assert all(m.forward.func is _fused_rms_norm for m in norms)
        _matches(_llama, losses, booster, model)
    elif case == "all_optimization":
        plugin = HybridParallelPlugin(tp_size=2, enable_all_optimization=True)
        losses, booster, model = _train(plugin, _llama, 2)
        assert model.unwrap().config._attn_implementation == "sdpa"
        norms = [m for m in model.unwrap().modules() if type(m).__name__ == "LlamaRMSNorm"]
        assert all(m.forward.func is _fused_rms_norm for m in norms)
        _matches(_llama, losses, booster, model)
    elif case == "parallel_output":
        for parallel, width in ((True, 48), (False, 96)):
            booster = Booster(plugin=HybridParallelPlugin(tp_size=2, parallel_output=parallel))
            model, *_ = booster.boost(_gpt2())
            ids = _ids(0)
            out = model(input_ids=ids, labels=ids)
            assert out.logits.shape[-1] == width, (parallel, out.logits.shape)
    elif case == "overlap_communication":
        plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, overlap_communication=False)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert booster.plugin.boosted(model).optimizer.overlap_communication is False
        _matches(_gpt2, losses, booster, model)
    dist.barrier()


def _llama_four_layers() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


CASES = [
    "microbatch_size",
    "num_model_chunks",
    "split_gather",
    "flash_attention",
    "fused_normalization",
    "all_optimization",
    "parallel_output",
    "overlap_communication",
]


def test_hybrid_arguments_do_what_they_say() -> None:
    run_subtests(check_accepted, 2, {"case": CASES}, timeout=280)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "both microbatch counts": (
        {"pp_size": 2, "num_microbatches": 2, "microbatch_size": 1},
        "both say how a batch splits; give one of them",
    ),
    "chunks without interleaving": (
        {"pp_size": 2, "num_model_chunks": 2},
        "pass pp_style='interleaved' with num_model_chunks=2",
    ),
    "ulysses": (
        {
            "tp_size": 2,
            "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": "all_to_all",
        },
        "all-to-all \\(Ulysses\\) and ring attention are not in pc yet",
    ),
    "sp_size": ({"tp_size": 2, "sp_size": 2}, "leave sp_size out"),
    "fp8": ({"fp8_communication": True}, "fp8 compression is not implemented"),
    "jit": ({"enable_jit_fused": True}, "torch.compile fuses the same element-wise ops"),
    "policy": ({"custom_policy": object()}, "register one there and leave custom_policy out"),
    "gathered pipeline logits": (
        {"pp_size": 2, "parallel_output": False},
        "gather them there with pc_tensor.gather_logits",
    ),
}


def check_refused() -> None:
    for kwargs, message in REFUSED.values():
        with pytest.raises(ValueError, match=message):
            HybridParallelPlugin(**kwargs)
    plugin = HybridParallelPlugin(pp_size=2, zero_stage=1, microbatch_size=3)
    booster = Booster(plugin=plugin)
    built = _gpt2()
    model, optimizer, *_ = booster.boost(built, torch.optim.AdamW(built.parameters()))
    ids = _ids(0)
    with pytest.raises(ValueError, match="do not split into micro-batches of microbatch_size=3"):
        booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model, None, optimizer)
    dist.barrier()


def test_hybrid_refusals() -> None:
    run_subtests(check_refused, 2, {}, timeout=120)
