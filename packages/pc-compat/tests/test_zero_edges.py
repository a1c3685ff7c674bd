"""``pc_compat.colossalai.zero`` with Colossal-AI's call shapes: at world 2,
``GeminiDDP`` + ``GeminiOptimizer`` / ``GeminiAdamOptimizer``,
``LowLevelZeroOptimizer`` (stages 1 and 2) and the stage wrappers train a
tiny fp32 model to the same losses and parameters as single-process
training on the whole batch (3 steps, rtol 1e-5, atol 1e-6), with the
arguments they honour set away from their defaults (clipping, the chunk
configuration, the Adam keywords, ``partition_grad``, ``backward_context``);
refused arguments raise ValueError saying why. One spawn runs every case."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_chunk import packing_waste
from pc_comm.testing import run_subtests
from pc_compat.colossalai.legacy.zero import ZeroDDP
from pc_compat.colossalai.nn.optimizer import HybridAdam
from pc_compat.colossalai.zero import (
    GeminiAdamOptimizer,
    GeminiDDP,
    GeminiOptimizer,
    LowLevelZeroOptimizer,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from pc_compat.colossalai.zero.gemini import (
    ChunkManager,
    GeminiManager,
    search_chunk_configuration,
)

pytestmark = pytest.mark.timeout(90)

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
LR = 1e-2
MEGA = 1024 * 1024
FP32: dict[str, Any] = {"mixed_precision": torch.float32}  # pc's; Colossal-AI's takes fp16/bf16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _batch(step: int, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    if not half:
        return x, y
    part = slice(dist.get_rank() * BATCH // 2, (dist.get_rank() + 1) * BATCH // 2)
    return x[part], y[part]


def _reference(
    adam: Callable[..., torch.optim.Optimizer], clip: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Single-process training on the whole batch."""
    model = _model()
    optimizer = adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(_batch(step, False)[0]), _batch(step, False)[1])
        loss.backward()  # type: ignore[no-untyped-call]
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return model.state_dict(), torch.stack(losses)


def _train(model: nn.Module, optimizer: Any) -> torch.Tensor:
    """Colossal-AI's loop on this rank's half of each batch; the mean loss."""
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _batch(step, True)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.backward(loss)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / 2)
    return torch.stack(losses)


def _assert_parity(
    state: dict[str, torch.Tensor],
    losses: torch.Tensor,
    adam: Callable[..., torch.optim.Optimizer],
    clip: float = 0.0,
) -> None:
    reference, ref_losses = _reference(adam, clip)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _refused(pattern: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=re.escape(pattern)):
        call()


# -- Gemini --------------------------------------------------------------------------------


def check_gemini_chunk_config_and_clipping() -> None:
    """search_chunk_configuration -> GeminiDDP(chunk_config_dict=) ->
    GeminiOptimizer(optim, module, max_norm=): the searched size is the one
    built, and clipping applies."""
    sizes = [p.numel() for p in _model().parameters()]
    config, total, waste = search_chunk_configuration(_model(), 300 / MEGA, 32, 0)
    best = min(range(1024, 1024 + 300 + 1, 32), key=lambda c: (packing_waste(sizes, c)[1], c))
    assert best != 1024  # the range is searched, not only its start
    assert config == {2: {"chunk_size": best, "keep_gathered": False}}, config
    assert (total, waste) == (sum(sizes), packing_waste(sizes, best)[1])
    model = GeminiDDP(_model(), chunk_config_dict=config, placement_policy="static", **FP32)
    assert model.manager.chunk_size == best
    optimizer = GeminiOptimizer(HybridAdam(model.parameters(), lr=LR), model, max_norm=0.05)
    losses = _train(model, optimizer)
    _assert_parity(model.full_state_dict(), losses, HybridAdam, clip=0.05)


def check_gemini_adam_default_search() -> None:
    """GeminiDDP's own search (a model under min_chunk_size_m is one chunk)
    and GeminiAdamOptimizer(model, lr=, initial_scale=): lr goes to Adam, the
    scale to the wrapper (no scaling in fp32, as no scaling in bf16 there)."""
    model = GeminiDDP(_model(), **FP32)
    assert [c.size for c in model.chunks] == [sum(p.numel() for p in _model().parameters())]
    optimizer = GeminiAdamOptimizer(model, lr=LR, initial_scale=2**5)
    assert optimizer.inner.defaults["lr"] == LR
    assert optimizer.loss_scale == 1.0
    losses = _train(model, optimizer)
    _assert_parity(model.full_state_dict(), losses, HybridAdam)


def check_stage3_wrappers() -> None:
    model = zero_model_wrapper(_model(), zero_stage=3, gemini_config=FP32)
    assert isinstance(model, GeminiDDP)
    optimizer = zero_optim_wrapper(model, HybridAdam(model.parameters(), lr=LR), max_norm=0.05)
    assert isinstance(optimizer, GeminiOptimizer)
    losses = _train(model, optimizer)
    _assert_parity(model.full_state_dict(), losses, HybridAdam, clip=0.05)


def check_chunk_manager() -> None:
    """The modern ChunkManager is the older tutorial's settings: ZeroDDP builds
    the configured chunks from it."""
    manager = ChunkManager({2: {"chunk_size": 1055, "keep_gathered": False}})
    assert manager.chunk_size == 1056  # rounded up to a multiple of the group
    model = ZeroDDP(_model(), GeminiManager("cuda", manager))
    assert [c.size for c in model.chunks] == [288, 1056, 132]


# -- low-level ZeRO ------------------------------------------------------------------------


def check_low_level(stage: int) -> None:
    """LowLevelZeroOptimizer(optimizer, clip_grad_norm=, partition_grad=,
    backward_context=) on a model left as it is."""
    model = _model()
    entered = []

    @contextmanager
    def context() -> Iterator[None]:
        entered.append(True)
        yield

    optimizer = LowLevelZeroOptimizer(
        torch.optim.Adam(model.parameters(), lr=LR),
        clip_grad_norm=0.05,
        partition_grad=stage == 2,
        backward_context=context,
        reduce_bucket_size=512,
    )
    assert optimizer.stage == stage
    losses = _train(model, optimizer)
    assert len(entered) == STEPS
    _assert_parity(model.state_dict(), losses, torch.optim.Adam, clip=0.05)


def check_stage2_wrappers() -> None:
    model = zero_model_wrapper(_model(), zero_stage=2)
    optimizer = zero_optim_wrapper(model, torch.optim.Adam(model.parameters(), lr=LR))
    assert isinstance(optimizer, LowLevelZeroOptimizer)
    assert optimizer.stage == 2
    losses = _train(model, optimizer)
    _assert_parity(model.state_dict(), losses, torch.optim.Adam)


# -- refusals ------------------------------------------------------------------------------


def check_refusals() -> None:
    model = _model()
    _refused(
        "GeminiDDP(shard_param_frac=0.5): pc's Gemini shards every chunk",
        lambda: GeminiDDP(_model(), shard_param_frac=0.5),
    )
    _refused("GeminiDDP(master_weights=False)", lambda: GeminiDDP(_model(), master_weights=False))
    _refused(
        "the chunk configuration is for a group of 4 ranks, but the chunks are sharded over 2",
        lambda: ChunkManager({4: {"chunk_size": 1024}}),
    )
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    _refused(
        "LowLevelZeroOptimizer(communication_dtype=torch.float16): pc reduces gradients in the "
        "parameters' dtype (torch.float32)",
        lambda: LowLevelZeroOptimizer(adam, communication_dtype=torch.float16),
    )
    _refused(
        "LowLevelZeroOptimizer(extra_dp_group=",
        lambda: LowLevelZeroOptimizer(adam, extra_dp_group=dist.group.WORLD),
    )
    wrapped = GeminiDDP(_model(), **FP32)
    _refused(
        "GeminiOptimizer(norm_type=1.0): pc clips by the global 2-norm",
        lambda: GeminiOptimizer(HybridAdam(wrapped.parameters()), wrapped, norm_type=1.0),
    )
    _refused(
        "zero_optim_wrapper: the model was not wrapped", lambda: zero_optim_wrapper(model, adam)
    )
    # Defaults are always accepted; forced_dtype casts the parameters first.
    cast = _model()
    LowLevelZeroOptimizer(torch.optim.SGD(cast.parameters(), lr=LR), forced_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in cast.parameters())


CASES: dict[str, Callable[[], None]] = {
    "gemini-chunk-config-clipping": check_gemini_chunk_config_and_clipping,
    "gemini-adam-default-search": check_gemini_adam_default_search,
    "stage3-wrappers": check_stage3_wrappers,
    "chunk-manager": check_chunk_manager,
    "low-level-stage1": lambda: check_low_level(1),
    "low-level-stage2": lambda: check_low_level(2),
    "stage2-wrappers": check_stage2_wrappers,
    "refusals": check_refusals,
}


def check_case(case: str) -> None:
    CASES[case]()


def test_zero_edges_train_as_colossalai_programs_call_them() -> None:
    run_subtests(check_case, 2, {"case": list(CASES)}, timeout=80)
