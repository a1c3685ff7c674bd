"""HybridParallelPlugin(sequence_parallelism_mode="all_to_all" (Ulysses) or
"ring_attn" (ring attention), sp_size=N): sequence parallelism of its own
size through the Booster, against single-process
training on the global batch (3 SGD steps, losses and every parameter):
sp 2 alone; dp 2 x sp 2 with DDP and with ZeRO-1; tp 2 x sp 2; pp 2 x sp 2
(execute_pipeline) with DDP and with ZeRO-1 and clipping. The sp
ranks of a replica share a batch; the dataloader's group leaves them out."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pc_booster import Booster, HybridParallelPlugin
from pc_comm.testing import run_subtests

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

STEPS, LR, BATCH, SEQ, VOCAB = 3, 0.1, 2, 16, 96


def _build() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def check_plugin(layout: str, mode: str) -> None:
    sizes = {  # tp, pp, ZeRO stage, clipping norm
        "sp": (1, 1, 0, 0.0), "dp-sp": (1, 1, 0, 0.0), "dp-sp-zero1-clip": (1, 1, 1, 0.5),
        "dp-sp-zero2": (1, 1, 2, 0.0), "tp-sp": (2, 1, 0, 0.0), "tp-sp-clip": (2, 1, 0, 0.5),
        "pp-sp": (1, 2, 0, 0.0), "pp-sp-zero1-clip": (1, 2, 1, 0.5),
    }  # fmt: skip
    tp, pp, zero, max_norm = sizes[layout]
    plugin = HybridParallelPlugin(
        tp_size=tp, pp_size=pp, zero_stage=zero, enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode, sp_size=2, max_norm=max_norm,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    data, data_rank = plugin.dp_size, dist.get_rank(plugin.dp_group)
    assert plugin.sp_size == 2
    assert data == dist.get_world_size() // (2 * tp * pp)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (BATCH * data, SEQ), generator=gen) for _ in range(STEPS)]

    reference = _build()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    for ids in batches:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.detach())

    built = _build()
    model, opt, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=LR))
    losses = []
    for ids in batches:
        mine = ids[data_rank * BATCH : (data_rank + 1) * BATCH]
        if pp > 1:  # BATCH rows in pp micro-batches, each rank its share of each sequence
            step = {"input_ids": mine, "labels": mine}
            loss = booster.execute_pipeline(iter([step]), model, None, opt)["loss"]
        else:
            loss = model(input_ids=mine, labels=mine).loss
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=plugin.dp_group)
        losses.append(total / data)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    state = plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key].float(), value, rtol=1e-5, atol=1e-6, msg=key)


def test_ulysses_through_the_plugin_matches_single_process() -> None:
    layouts = ["dp-sp", "dp-sp-zero1-clip", "dp-sp-zero2", "tp-sp", "tp-sp-clip"]
    cases = {"layout": layouts, "mode": ["all_to_all", "ring_attn"]}
    run_subtests(check_plugin, 4, cases, timeout=280)


def test_sequence_parallelism_inside_pipeline_stages_matches_single_process() -> None:
    """pp 2 x sp 2: each stage's two ranks split every micro-batch's
    sequence; Llama from its base_model_pp_plan."""
    cases = {"layout": ["pp-sp", "pp-sp-zero1-clip"], "mode": ["all_to_all", "ring_attn"]}
    run_subtests(check_plugin, 4, cases, timeout=280)


def test_ulysses_alone_at_world_2() -> None:
    run_subtests(
        check_plugin, 2, {"layout": ["sp"], "mode": ["all_to_all", "ring_attn"]}, timeout=200
    )


def test_ulysses_refusals() -> None:
    with pytest.raises(ValueError, match=r"pass sp_size >= 2"):
        HybridParallelPlugin(
            enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"
        )
    with pytest.raises(ValueError, match=r"inside pipeline stages with tensor parallelism too"):
        HybridParallelPlugin(
            tp_size=2, pp_size=2, enable_sequence_parallelism=True,
            sequence_parallelism_mode="all_to_all", sp_size=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"'split_gather', inside tensor parallelism\) with pipe"):
        HybridParallelPlugin(tp_size=2, pp_size=2, enable_sequence_parallelism=True)
    # bf16 and fp16 are accepted: proven in integration_tests/test_booster_precision.py.
    Booster(
        plugin=HybridParallelPlugin(
            zero_stage=1, enable_sequence_parallelism=True,
            sequence_parallelism_mode="all_to_all", sp_size=2,
        ),
        mixed_precision="bf16",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'ring_attn' \(ring attention\)"):
        HybridParallelPlugin(
            tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring"
        )
