"""``shard_model`` on tiny ``transformers`` GPT-2, Llama, BERT, OPT and
Bloom against the same unsharded model: loss, full logits, every gradient
and every parameter after AdamW steps, at tp 2 and 4, with and without
sequence parallelism; vocabularies tp does not divide are padded; bad
configurations are refused with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tp_models import MODELS, batch, build
from transformers import GPT2Config, GPT2Model

from pc_comm.testing import run_subtests
from pc_tensor import full_state_dict, gather_logits, shard_info, shard_model

pytestmark = pytest.mark.timeout(600)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)


def check_model_matches_unsharded(name: str, sequence_parallel: bool) -> None:
    ref = build(name)
    vocab = ref.config.vocab_size
    model = shard_model(copy.deepcopy(ref), dist.group.WORLD, sequence_parallel=sequence_parallel)
    info = shard_info(model)
    tp = dist.get_world_size()
    assert info.padded_vocab_size % tp == 0
    assert info.padded_vocab_size - vocab < tp

    # Per-rank parameter bytes: 1/tp of the sharded layers' (padded) total.
    full = dict(ref.named_parameters())
    local = dict(model.named_parameters())
    mine = sum(local[n].numel() * local[n].element_size() for n in info.sharded)
    whole = 0
    for n in info.sharded:
        numel = full[n].numel()
        if info.specs[n].size is not None:  # vocabulary rows, padded
            numel = numel // vocab * info.padded_vocab_size
        whole += numel * full[n].element_size()
    assert mine * tp == whole, (mine, tp, whole)
    assert len(info.sharded) > 10

    ref_opt, opt = _adamw(ref), _adamw(model)
    for step in range(3):
        inputs = batch(name, step, vocab)
        out_ref, out = ref(**inputs), model(**inputs)
        _close(out.loss, out_ref.loss, f"step {step} loss")
        _close(gather_logits(out.logits, model), out_ref.logits, f"step {step} logits")
        out_ref.loss.backward()
        out.loss.backward()
        grads = full_state_dict(model, grads=True)
        for key, value in ref.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter) and value.grad is not None:
                _close(grads[key], value.grad, f"step {step} grad {key}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        state = full_state_dict(model)
        for key, value in ref.state_dict().items():
            _close(state[key], value, f"step {step} {key}")
    # The padded vocabulary rows stayed zero (no id reaches them).
    emb: torch.Tensor = model.get_input_embeddings().weight
    rank = dist.get_rank()
    rows = torch.arange(rank * emb.shape[0], (rank + 1) * emb.shape[0])
    assert torch.count_nonzero(emb[rows >= vocab]) == 0
    # The sharded state loads into a fresh unsharded model.
    fresh = build(name, seed=1)
    fresh.load_state_dict(full_state_dict(model))
    _close(fresh(**batch(name, 9, vocab)).loss, ref(**batch(name, 9, vocab)).loss, "reloaded")


def check_base_model_sequence_parallel() -> None:
    """A model without an LM head: the blocks' output is gathered back."""
    torch.manual_seed(0)
    ref = GPT2Model(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    model = shard_model(copy.deepcopy(ref), sequence_parallel=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    h_ref, h = ref(ids).last_hidden_state, model(ids).last_hidden_state
    _close(h, h_ref, "last_hidden_state")
    h_ref.square().mean().backward()
    h.square().mean().backward()
    grads = full_state_dict(model, grads=True)
    for key, value in ref.named_parameters():
        assert value.grad is not None
        _close(grads[key], value.grad, f"grad {key}")


def check_bad_configurations() -> None:
    tp = dist.get_world_size()
    with pytest.raises(ValueError, match=r"n_head = 3 is not divisible by the tensor-parallel"):
        shard_model(build("gpt2", n_head=3, n_embd=24))
    with pytest.raises(ValueError, match=r"num_key_value_heads = 1 is not divisible"):
        shard_model(build("llama", num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"no hand-written policy for it \(those cover bert"):
        shard_model(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"the vocabulary size \(101\) is not divisible"):
        shard_model(build("gpt2"), pad_vocab=False)
    model = shard_model(build("gpt2"), sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"pad the sequence length to a multiple of {tp}"):
        model(torch.zeros(1, 4 * tp + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"already sharded"):
        shard_model(model)


def check_all(case: str, sequence_parallel: bool) -> None:
    if case in MODELS:
        check_model_matches_unsharded(case, sequence_parallel)
    elif case == "base-model" and sequence_parallel:
        check_base_model_sequence_parallel()
    elif case == "errors" and not sequence_parallel:
        check_bad_configurations()


@pytest.mark.parametrize("world_size", [2, 4])
def test_models_match_unsharded(world_size: int) -> None:
    run_subtests(
        check_all,
        world_size,
        {"case": [*MODELS, "base-model", "errors"], "sequence_parallel": [False, True]},
        timeout=540,
    )
