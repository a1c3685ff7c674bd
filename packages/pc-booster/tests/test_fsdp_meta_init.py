"""A model built on the meta device under TorchFSDPPlugin (FSDP2's own init
pattern) [Note: meta-device models under FSDP2]: boost allocates each rank's
shards and initialises them with the model's init_weights(), each rank's
shards drawn apart, the buffers it computes (rotary frequencies) exact; then
training from that start matches single-process training from the same
values (fp32, rtol 1e-5 / atol 1e-6). A model with buffers and no
init_weights() is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pc_booster import Booster, TorchFSDPPlugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _batch(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 64, (size, 8), generator=torch.Generator().manual_seed(300 + step))


def check_meta_model_trains() -> None:
    with torch.device("meta"):
        meta = _llama()
    booster = Booster(plugin=TorchFSDPPlugin())
    optimizer: Any = torch.optim.SGD(meta.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, *_ = booster.boost(meta, optimizer)
    start = booster.plugin.model_state_dict(model)
    # Not the same draw on every rank: the embedding's two halves (one per
    # rank's shard) differ, and the rotary frequencies are computed exactly.
    weight = start["model.embed_tokens.weight"]
    assert not torch.equal(weight[:32], weight[32:])
    assert 0.01 < float(weight.std()) < 0.04
    eager = _llama()
    built = booster.unwrap(model)
    assert isinstance(built, LlamaForCausalLM)
    torch.testing.assert_close(built.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    reference = _llama()
    reference.load_state_dict(start)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        ids = _batch(step, 2 * world)
        mine = ids[2 * rank : 2 * rank + 2]
        loss = model(input_ids=mine, labels=mine).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(mean / world, want.detach(), rtol=1e-5, atol=1e-6)
    state = booster.plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * self.scale
        return out


def check_buffers_without_init_weights_are_refused() -> None:
    with torch.device("meta"):
        model = _WithBuffer()
    booster = Booster(plugin=TorchFSDPPlugin())
    with pytest.raises(ValueError, match="has buffers but no init_weights"):
        booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    dist.barrier()


CASES = {
    "trains": check_meta_model_trains,
    "refused": check_buffers_without_init_weights_are_refused,
}


def run(case: str) -> None:
    CASES[case]()


def test_meta_device_models_under_fsdp2() -> None:
    run_subtests(run, 2, {"case": list(CASES)}, timeout=240)
