"""Ulysses sequence parallelism (pc_tensor.ulysses_model) and ring attention
(pc_tensor.ring_model, zig-zag) against single-process training of the same
model on the same global batch: 3 SGD steps,
losses and every parameter, on Llama and Qwen2 tiny models with grouped-
query attention (4 query heads over 2 key/value heads), at sp 2 and sp 4
(key/value heads repeated), dp 2 x sp 2 and tp 2 x sp 2; and the
refusals, with their numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pc_comm.testing import run_subtests

transformers = pytest.importorskip("transformers")

from pc_tensor import (  # noqa: E402
    full_state_dict,
    ring_model,
    shard_model,
    sync_sequence_grads,
    ulysses_model,
)

pytestmark = pytest.mark.timeout(300)

STEPS, LR, BATCH, SEQ, VOCAB = 3, 0.1, 4, 16, 96


def _build(family: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **({"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0} if family == "gpt2" else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa"
    )
    return model


def _batches(dp: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (BATCH * dp, SEQ), generator=gen) for _ in range(STEPS)]


def _groups(world: int, inner: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Groups of ``inner`` consecutive ranks, and across them (every rank
    makes every group, in one order)."""
    rank = dist.get_rank()
    mine_inner = mine_outer = None
    for start in range(0, world, inner):
        group = dist.new_group(list(range(start, start + inner)))
        if start <= rank < start + inner:
            mine_inner = group
    for offset in range(inner):
        group = dist.new_group(list(range(offset, world, inner)))
        if rank % inner == offset:
            mine_outer = group
    assert mine_inner is not None
    assert mine_outer is not None
    return mine_inner, mine_outer


def check_ulysses(family: str, layout: str, mode: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_group: dist.ProcessGroup | None
    dp = 1
    tp_group = dp_group = None
    if layout == "sp":
        sp_group = dist.group.WORLD
    elif layout == "dp-sp":  # sp inside consecutive pairs, dp across them
        sp_group, dp_group = _groups(world, 2)
        dp = 2
    else:  # tp-sp: tp inside consecutive pairs, sp across them
        tp_group, sp_group = _groups(world, 2)
    assert sp_group is not None
    batches = _batches(dp)

    reference = _build(family)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    for ids in batches:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.detach())

    model = _build(family)
    if tp_group is not None:
        shard_model(model, tp_group)
    (ulysses_model if mode == "ulysses" else ring_model)(model, sp_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        mine = ids
        if dp_group is not None:  # each data-parallel rank its half of the batch
            d = dist.get_rank(dp_group)
            mine = ids[d * BATCH : (d + 1) * BATCH]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        sync_sequence_grads(model, sp_group)
        if dp_group is not None:
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=dp_group)
                    param.grad /= dist.get_world_size(dp_group)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(dp_group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    state = full_state_dict(model) if tp_group is not None else model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    del rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_single_process(world_size: int) -> None:
    layouts = ["sp"] if world_size == 2 else ["sp", "dp-sp", "tp-sp"]
    # GPT-2's head is GPT2LMHeadModel: a causal language model by another name.
    families = ["llama", "qwen2", "gpt2"] if world_size == 2 else ["llama", "qwen2"]
    cases = {"family": families, "layout": layouts, "mode": ["ulysses", "ring"]}
    run_subtests(check_ulysses, world_size, cases, timeout=280)


def check_refusals() -> None:
    model = ulysses_model(_build("llama"), dist.group.WORLD)
    with pytest.raises(ValueError, match=r"15 tokens do not divide by 2"):
        model(input_ids=torch.randint(3, VOCAB, (1, 15)))
    ids = torch.randint(3, VOCAB, (1, 16))
    padded = torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)
    with pytest.raises(ValueError, match=r"the batch has padding"):
        model(input_ids=ids, attention_mask=padded)
    with pytest.raises(ValueError, match=r"already runs sequence parallelism"):
        ulysses_model(model, dist.group.WORLD)
    ring = ring_model(_build("llama"), dist.group.WORLD)
    with pytest.raises(ValueError, match=r"into 4 equal blocks: 18 tokens do not divide by 4"):
        ring(input_ids=torch.randint(3, VOCAB, (1, 18)))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=3, num_key_value_heads=3,
    )  # fmt: skip
    odd = ulysses_model(transformers.LlamaForCausalLM(config), dist.group.WORLD)
    with pytest.raises(ValueError, match=r"has 3 query heads"):
        odd(input_ids=torch.randint(3, VOCAB, (1, 16)))
    dist.barrier()


def test_ulysses_refusals() -> None:
    run_subtests(check_refusals, 2, {}, timeout=120)
