"""bf16 masters with stochastic rounding under the plugins ([Note:
low-precision optimizer states] in pc_offload.states): where the plugin
keeps fp32 masters of bf16 parameters itself (ZeRO, Gemini, FSDP2's mixed
precision) the option is refused, naming why and what to do; where the
optimizer steps the bf16 parameters itself (DDP with a bf16 model) it
keeps no fp32 copy and trains as one process does. A gloo group of one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pc_booster import Booster
from pc_booster.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchFSDPPlugin
from pc_comm import DistributedDataParallel
from pc_comm.testing import one_process_group
from pc_offload import CPUAdamW


@pytest.fixture(scope="module", autouse=True)
def _group() -> Iterator[None]:
    with one_process_group():
        yield


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


@pytest.mark.parametrize(
    "plugin",
    [
        lambda: LowLevelZeroPlugin(stage=2),
        lambda: LowLevelZeroPlugin(stage=1),
        lambda: GeminiPlugin(),
        lambda: TorchFSDPPlugin(),
    ],
    ids=["zero2", "zero1", "gemini", "torch-fsdp"],
)
def test_refused_where_the_plugin_keeps_fp32_masters(plugin: Any) -> None:
    model = _model()
    optimizer = CPUAdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="there are no bf16 masters to round") as found:
        Booster(plugin=plugin(), mixed_precision="bf16").boost(model, optimizer)
    assert "Drop the option" in str(found.value)


def test_pc_comm_ddp_over_a_bf16_model_keeps_bf16_masters_and_trains_as_one_process() -> None:
    reference = _model(torch.bfloat16)
    alone = CPUAdamW(reference.parameters(), lr=1e-3, bf16_stochastic_round=True)
    model = _model(torch.bfloat16)
    optimizer = CPUAdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    wrapped = DistributedDataParallel(model)
    for step in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
        reference(x).float().square().mean().backward()
        alone.step()
        alone.zero_grad()
        wrapped(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert q.dtype == torch.bfloat16
        assert torch.equal(p, q)
    assert all("master" not in alone.state[p] for p in reference.parameters())


def test_a_norm_shared_by_two_parents_is_fused_once_in_both() -> None:
    """enable_fused_normalization puts one FusedRMSNorm, holding the same
    weight, wherever the model reaches the norm."""
    from types import SimpleNamespace

    from pc_booster.plugins.optimizations import FusedRMSNorm, apply_optimizations

    class LlamaLikeRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

    norm = LlamaLikeRMSNorm()
    model = nn.ModuleDict({"a": nn.Sequential(norm), "b": nn.Sequential(norm)})
    options = SimpleNamespace(flash_attention=lambda: False, fused_normalization=lambda: True)
    apply_optimizations(model, options)
    first, second = model.get_submodule("a.0"), model.get_submodule("b.0")
    assert isinstance(first, FusedRMSNorm)
    assert first is second
    assert first.weight is norm.weight
