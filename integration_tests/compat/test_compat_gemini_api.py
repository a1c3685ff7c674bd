"""Colossal-AI's Gemini tutorial ("ZeRO with chunk-based memory management")
on pc with only the imports changed, written from its public call shapes:
``init_chunk_manager(model=, init_device=, hidden_dim=, search_range_mb=,
min_chunk_size_mb=)``, ``GeminiManager(policy, chunk_manager)``,
``ZeroDDP(model, gemini_manager)``, ``GeminiAdamOptimizer(model, lr=,
initial_scale=)`` driven by ``optimizer.backward(loss)`` and
``optimizer.step()``; the older ``ChunkManager.search_chunk_size`` /
``ChunkManager(chunk_size, pg, enable_distributed_storage=, init_device=)``
/ ``ZeroOptimizer`` shape; ``GeminiDDP(model, device=, placement_policy=,
pin_memory=, search_range_mb=, hidden_dim=, min_chunk_size_mb=)`` and
``ColoInitContext(device=)``. At world 2 every training case matches plain
single-process training on the whole batch (losses and parameters, fp32);
every accepted argument has a case that fails if it were ignored; every
refusal is checked by its exact text. One spawn runs every sub-case."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_chunk import is_lazy, packing_waste
from pc_comm.testing import run_subtests
from pc_compat.colossalai.accelerator import get_accelerator
from pc_compat.colossalai.legacy.zero import (
    ChunkManager,
    GeminiAdamOptimizer,
    GeminiManager,
    ZeroDDP,
    ZeroOptimizer,
    init_chunk_manager,
)
from pc_compat.colossalai.legacy.zero._tutorial import ColoInitContext
from pc_offload import HybridAdam
from pc_zero import GeminiDDP

pytestmark = pytest.mark.timeout(120)

STEPS = 3
BATCH = 8
RTOL, ATOL = 1e-5, 1e-6
MEGA = 1024 * 1024
ADAM: dict[str, Any] = {"lr": 1e-2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _sizes(model: nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x.to(_device())).float(), y.to(_device()))


def _device() -> torch.device:
    device: torch.device = get_accelerator().get_current_device()
    return device


def _reference(adam: dict[str, Any], clip: float = 0.0) -> tuple[nn.Module, list[torch.Tensor]]:
    """Plain single-process training on the whole batch."""
    model = _model().to(_device())
    opt = HybridAdam(model.parameters(), **adam)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step))
        loss.backward()  # type: ignore[no-untyped-call]
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _my_half(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    half = BATCH // dist.get_world_size()
    lo = dist.get_rank() * half
    return x[lo : lo + half], y[lo : lo + half]


def _train_tutorial(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """The tutorial's loop, on this rank's half of each batch."""
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _loss(model, *_my_half(step))
        optimizer.backward(loss)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / dist.get_world_size())
    return losses


def _assert_parity(
    wrapped: GeminiDDP, losses: list[torch.Tensor], adam: dict[str, Any], clip: float = 0.0
) -> None:
    reference, ref_losses = _reference(adam, clip)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)
    full = wrapped.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _refused(text: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(text) + "$"):
        call()


# -- the tutorial ------------------------------------------------------------------------


def check_tutorial(policy: str) -> None:
    """init_chunk_manager -> GeminiManager -> ZeroDDP -> GeminiAdamOptimizer,
    under each placement policy."""
    model = _model()
    chunk_manager = init_chunk_manager(
        model=model,
        init_device=GeminiManager.get_default_device(policy),
        hidden_dim=32,
        search_range_mb=0,
        min_chunk_size_mb=1040 / MEGA,
    )
    # search_range 0: the smallest multiple of hidden_dim at or above both
    # the minimum (1040) and the largest parameter (1024).
    assert chunk_manager.chunk_size == 1056
    budget = {"device_budget_bytes": 26_000} if policy == "auto" else {}
    gemini_manager = GeminiManager(policy, chunk_manager, **budget)
    model = ZeroDDP(model, gemini_manager)
    on_device = [c.shard_on_device for c in model.chunks]
    assert {"cuda": all(on_device), "cpu": not any(on_device)}.get(policy, True), on_device
    if policy == "auto":  # the budget holds some chunks, not all
        assert any(on_device), on_device
        assert not all(on_device), on_device
    # Packed by 1056 (a chunk is trimmed to what it holds).
    assert model.manager.chunk_size == 1056
    assert [c.size for c in model.chunks] == [288, 1056, 132]
    optimizer = GeminiAdamOptimizer(model, lr=ADAM["lr"], initial_scale=2**5)
    assert optimizer.loss_scale == 2**5
    _assert_parity(model, _train_tutorial(model, optimizer), ADAM)


def check_search_arguments() -> None:
    """Each search argument of init_chunk_manager changes the chunk size
    as Colossal-AI's search does."""
    model = _model()
    sizes = _sizes(model)
    smaller_minimum = init_chunk_manager(
        model=model, hidden_dim=64, search_range_mb=0, min_chunk_size_mb=0
    )
    assert smaller_minimum.chunk_size == 1024  # the largest parameter bounds it
    # A range above the start: the least padding among multiples of hidden_dim in it.
    ranged = init_chunk_manager(
        model=model, hidden_dim=32, search_range_mb=300 / MEGA, min_chunk_size_mb=0
    )
    candidates = range(1024, 1024 + 300 + 1, 32)
    best = min(candidates, key=lambda c: (packing_waste(sizes, c)[1], c))
    assert ranged.chunk_size == best != 1024
    # Default hidden_dim: 1024, as Colossal-AI's.
    assert (
        init_chunk_manager(model=model, search_range_mb=0, min_chunk_size_mb=0).chunk_size == 1024
    )
    # A model smaller than min_chunk_size_mb: one chunk of it all.
    one = init_chunk_manager(model=model, search_range_mb=1, min_chunk_size_mb=32)
    assert one.chunk_size == sum(sizes)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        init_chunk_manager(model=model, search_range_mb=0, min_chunk_size_mb=0, verbose=True)
    assert ("wasted number" in out.getvalue()) == (dist.get_rank() == 0), out.getvalue()


def _with_large_parameter() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)], nn.Linear(4, 2500, bias=False))


def check_filter_exlarge_params() -> None:
    """The very large parameter is left out of the search and gets a chunk
    of its own; training still matches."""
    model = _with_large_parameter()
    kept = ChunkManager.search_chunk_size(model, 64, 4)
    assert kept == 48, kept  # of 16, 32, ... 80: the 10000-element weight left out
    unfiltered = ChunkManager.search_chunk_size(model, 64, 4, filter_exlarge_params=False)
    assert unfiltered == 10000, unfiltered
    manager = init_chunk_manager(model=model, hidden_dim=32, search_range_mb=0, min_chunk_size_mb=0)
    assert manager.chunk_size == 32
    no_filter = init_chunk_manager(
        model=model, hidden_dim=32, search_range_mb=0, min_chunk_size_mb=0,
        filter_exlarge_params=False,
    )  # fmt: skip
    assert no_filter.chunk_size == 10016
    wrapped = ZeroDDP(model, GeminiManager("cuda", manager))
    assert sorted(c.size for c in wrapped.chunks)[-1] == 10000  # its own chunk
    assert [len(c.slots) for c in wrapped.chunks if c.size == 10000] == [1]


def check_legacy_shape(chunk_size: str) -> None:
    """ChunkManager.search_chunk_size + ChunkManager(chunk_size, pg, ...)
    + ZeroOptimizer(HybridAdam(...), model, initial_scale=)."""
    model = _model()
    size = ChunkManager.search_chunk_size(model, 64 * 4, 4) if chunk_size == "searched" else None
    # Of 1024, 1088, ... 1280 (64 apart), 1216 pads least.
    assert size is None or size == 1216, size
    chunk_manager = ChunkManager(
        size,
        dist.group.WORLD,
        enable_distributed_storage=True,
        init_device=GeminiManager.get_default_device("cpu"),
    )
    model = ZeroDDP(model, GeminiManager("cpu", chunk_manager))
    if size is None:  # one chunk per tensor
        assert len(model.chunks) == len(list(model.parameters()))
        assert all(len(c.slots) == 1 for c in model.chunks)
    else:
        assert model.manager.chunk_size == size
        assert [c.size for c in model.chunks] == [288, 1188]
    assert not any(c.shard_on_device for c in model.chunks)
    optimizer = ZeroOptimizer(HybridAdam(model.parameters(), **ADAM), model, initial_scale=2**5)
    _assert_parity(model, _train_tutorial(model, optimizer), ADAM)


def check_gemini_ddp_arguments(policy: str) -> None:
    """GeminiDDP with Colossal-AI's keyword arguments."""
    model = GeminiDDP(
        _model(),
        device=_device(),
        placement_policy=policy,
        pin_memory=True,
        search_range_mb=0,
        hidden_dim=32,
        min_chunk_size_mb=1040 / MEGA,
    )
    assert model.manager.chunk_size == 1056
    assert [c.size for c in model.chunks] == [288, 1056, 132]
    on_device = [c.shard_on_device for c in model.chunks]
    assert all(on_device) if policy == "cuda" else not any(on_device)
    if model.manager.device.type == "cuda" and policy == "cpu":
        assert all(c.shard is not None and c.shard.is_pinned() for c in model.chunks)
    adam: dict[str, Any] = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1,
            "adamw_mode": False, "bias_correction": False}  # fmt: skip
    optimizer = GeminiAdamOptimizer(model, **adam)
    _assert_parity(model, _train_tutorial(model, optimizer), adam)


# -- what the optimizer does -------------------------------------------------------------


def check_step_clears_and_accumulates() -> None:
    """step() leaves no gradient; two micro-batches per step (no zero_grad
    anywhere) equal one whole batch per step."""
    model = ZeroDDP(_model(), GeminiManager("cuda", init_chunk_manager(
        model=_model(), hidden_dim=64, search_range_mb=0, min_chunk_size_mb=0)))  # fmt: skip
    optimizer = GeminiAdamOptimizer(model, **ADAM)
    losses = []
    for step in range(STEPS):
        x, y = _my_half(step)
        total = torch.zeros((), device=_device())
        for micro in range(2):
            part = slice(micro * len(x) // 2, (micro + 1) * len(x) // 2)
            loss = _loss(model, x[part], y[part]) / 2
            optimizer.backward(loss)
            total += loss.detach()
        optimizer.step()
        assert all(p.grad is None for p in model.parameters())
        assert all(c.grad_shard is None for c in model.chunks)
        dist.all_reduce(total)
        losses.append(total / dist.get_world_size())
    _assert_parity(model, losses, ADAM)


def check_clipping_norm() -> None:
    model = ZeroDDP(_model(), GeminiManager("cuda", ChunkManager(1024, None, True)))
    optimizer = GeminiAdamOptimizer(model, clipping_norm=0.05, **ADAM)
    _assert_parity(model, _train_tutorial(model, optimizer), ADAM, clip=0.05)


def check_loss_scale_arguments() -> None:
    """initial_scale, growth_interval, growth_factor, max_scale on good
    steps; backoff_factor, hysteresis, min_scale and verbose on overflow."""
    model = ZeroDDP(_model(), GeminiManager("cuda", ChunkManager(1024, None, True)))
    optimizer = GeminiAdamOptimizer(
        model, initial_scale=2**10, growth_interval=1, growth_factor=4, max_scale=2**13, **ADAM
    )
    scales = []
    for step in range(2):
        optimizer.backward(_loss(model, *_my_half(step)))
        optimizer.step()
        scales.append(optimizer.loss_scale)
    assert scales == [2**12, 2**13], scales
    model = ZeroDDP(_model(), GeminiManager("cuda", ChunkManager(1024, None, True)))
    optimizer = GeminiAdamOptimizer(
        model, initial_scale=2**120, max_scale=2**120, min_scale=2**117, backoff_factor=0.25,
        hysteresis=1, verbose=True, **ADAM,
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    printed = []
    for step in range(2):  # 1e40-scale losses overflow fp32: skipped, scale backs off
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            optimizer.backward(_loss(model, *_my_half(step)) * 2.0**100)
            optimizer.step()
        printed.append(out.getvalue())
        assert optimizer.last_step_skipped
    assert optimizer.loss_scale == 2**117  # 2**118, then held at min_scale
    assert all("skipped the step" in text for text in printed), printed
    for name, value in model.full_state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def check_force_outputs_fp32() -> None:
    for force in (False, True):
        model = ZeroDDP(
            _model(),
            GeminiManager("cuda", ChunkManager(1024, None, True)),
            force_outputs_fp32=force,
            mixed_precision=torch.bfloat16,
        )
        out = model(torch.randn(2, 8, device=_device()))
        assert out.dtype == (torch.float32 if force else torch.bfloat16)


def check_colo_init_context(lazy: bool) -> None:
    with ColoInitContext(device=_device(), lazy=lazy):
        model = _model()
    assert all(is_lazy(p) == lazy for p in model.parameters())
    if not lazy:
        assert all(p.device == _device() for p in model.parameters())
    with ColoInitContext(device="cpu", dtype=torch.float64):
        wide = nn.Linear(2, 2)
    assert wide.weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    model = ZeroDDP(model, GeminiManager("cuda", ChunkManager(1024, None, True)))
    optimizer = GeminiAdamOptimizer(model, **ADAM)
    _assert_parity(model, _train_tutorial(model, optimizer), ADAM)


# -- refusals ----------------------------------------------------------------------------


def check_refusals() -> None:
    model = _model()
    _refused(
        "ChunkManager(enable_distributed_storage=False) keeps whole chunks on every rank; "
        "pc's chunks are always sharded over the group (2 ranks), which gives the same "
        "training at a 1/N of the memory. Pass enable_distributed_storage=True, or use "
        "pc_comm.DistributedDataParallel for replicated parameters.",
        lambda: ChunkManager(1024, None),
    )
    _refused(
        "ZeroDDP(strict_ddp_mode=True) keeps every parameter whole on every rank; pc's "
        "chunks are always sharded. Use pc_comm.DistributedDataParallel for that.",
        lambda: ZeroDDP(
            model, GeminiManager("cuda", ChunkManager(1024, None, True)), strict_ddp_mode=True
        ),
    )
    _refused(
        "init_chunk_manager(strict_ddp_flag=True) keeps every parameter whole on every rank; "
        "pc's chunks are always sharded. Use pc_comm.DistributedDataParallel for plain data "
        "parallelism.",
        lambda: init_chunk_manager(model=model, search_range_mb=1, strict_ddp_flag=True),
    )
    _refused(
        "GeminiManager(memstats=...): pc has no Colossal-AI MemStats; its 'auto' placement "
        "measures non-model memory itself (GeminiDDP(example_inputs=...)).",
        lambda: GeminiManager("auto", ChunkManager(1024, None, True), object()),
    )
    _refused(
        "ZeroDDP: the ChunkManager's init_device=meta is not where placement_policy='cpu' "
        "keeps chunk shards (cpu). Pass init_device=None or "
        "GeminiManager.get_default_device('cpu'), or choose the placement policy that keeps "
        "them there.",
        lambda: ZeroDDP(model, GeminiManager("cpu", ChunkManager(1024, None, True, "meta"))),
    )
    wrapped = ZeroDDP(_model(), GeminiManager("cuda", ChunkManager(1024, None, True)))
    _refused(
        "gpu_margin_mem_ratio=0.5: pc does not move optimizer states into spare GPU memory "
        "after the first step; its 'auto' placement plans the device at construction "
        "(GeminiManager('auto', ..., device_budget_bytes=)).",
        lambda: GeminiAdamOptimizer(wrapped, gpu_margin_mem_ratio=0.5),
    )
    _refused(
        "norm_type=1.0: pc clips by the L2 norm only (norm_type=2.0).",
        lambda: GeminiAdamOptimizer(wrapped, norm_type=1.0),
    )
    _refused(
        "ColoInitContext(default_pg=, default_dist_spec=): pc builds plain torch parameters; "
        "tensor parallelism is pc-tensor's (HybridParallelPlugin(tp_size=...) or pc_tensor's "
        "plans). Drop these arguments.",
        lambda: ColoInitContext(default_pg=object()),
    )
    _refused(
        "placement_policy must be one of ['static', 'auto', 'cuda', 'cpu'], got 'gpu'.",
        lambda: GeminiManager("gpu", ChunkManager(1024, None, True)),
    )
    _refused(
        "offload_param_frac=0.5 is the host fraction of placement_policy='static'; "
        "placement_policy='cpu' decides the host fraction itself. Pass "
        "placement_policy='static' to choose it.",
        lambda: GeminiDDP(_model(), placement_policy="cpu", offload_param_frac=0.5),
    )
    _refused(
        "GeminiDDP: pass search_range (elements) or search_range_mb (2**20 elements), not both.",
        lambda: GeminiDDP(_model(), search_range=1024, search_range_mb=1),
    )
    if _device().type == "cpu":
        _refused(
            "ColoInitContext(device='cuda'): CUDA is not available here; pass device='cpu' "
            "or get_accelerator().get_current_device().",
            lambda: ColoInitContext(device="cuda"),
        )


def check_auto_without_budget() -> None:
    """'auto' with no budget plans against the device's free memory: on a
    CPU-only machine the host's, which holds every chunk here."""
    model = ZeroDDP(_model(), GeminiManager("auto", ChunkManager(1024, None, True)))
    assert all(c.shard_on_device for c in model.chunks)


CASES: dict[str, Callable[[], None]] = {
    "auto-without-budget": check_auto_without_budget,
    "tutorial-cuda": lambda: check_tutorial("cuda"),
    "tutorial-cpu": lambda: check_tutorial("cpu"),
    "tutorial-auto": lambda: check_tutorial("auto"),
    "search-arguments": check_search_arguments,
    "filter-exlarge-params": check_filter_exlarge_params,
    "legacy-searched": lambda: check_legacy_shape("searched"),
    "legacy-per-tensor": lambda: check_legacy_shape("none"),
    "gemini-ddp-cpu": lambda: check_gemini_ddp_arguments("cpu"),
    "gemini-ddp-cuda": lambda: check_gemini_ddp_arguments("cuda"),
    "step-clears-and-accumulates": check_step_clears_and_accumulates,
    "clipping-norm": check_clipping_norm,
    "loss-scale-arguments": check_loss_scale_arguments,
    "force-outputs-fp32": check_force_outputs_fp32,
    "colo-init-context-eager": lambda: check_colo_init_context(False),
    "colo-init-context-lazy": lambda: check_colo_init_context(True),
    "refusals": check_refusals,
}


def check_case(case: str) -> None:
    CASES[case]()


def test_colossal_gemini_tutorial_runs_on_pc() -> None:
    run_subtests(check_case, 2, {"case": list(CASES)}, timeout=110)
