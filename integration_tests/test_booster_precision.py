"""Mixed precision through the Booster, against a single-process reference
that uses the same precision (the model in fp16/bf16, fp32 master weights
stepped by AdamW, fp16 losses scaled by 2^10 with overflowing steps
skipped); and the configurations the Booster refuses, with their messages.

Tolerance (documented in docs/packages/pc-booster.md): losses within
rtol 2e-2 for bf16 and 5e-3 for fp16 over 5 steps. The ranks sum their
low-precision gradients in a different order than one process does, and
bf16 keeps 8 bits of mantissa."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from booster_models import batch, build
from safetensors.torch import load_file

from pc_booster import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(600)


def _sequence_parallel(mode: str) -> Plugin:
    return HybridParallelPlugin(
        enable_sequence_parallelism=True, sequence_parallelism_mode=mode, sp_size=2,
        zero_stage=1, initial_scale=SCALE,
    )  # fmt: skip


PLUGINS: dict[str, Callable[[], Plugin]] = {
    "zero1": lambda: LowLevelZeroPlugin(stage=1, initial_scale=SCALE),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, initial_scale=SCALE),
    "gemini": lambda: GeminiPlugin(initial_scale=SCALE),
    "torch-fsdp": TorchFSDPPlugin,
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1, initial_scale=SCALE),
    # Sequence parallelism of its own (dp 2 x sp 2), on a Llama with
    # grouped-query attention.
    "hybrid-sp2-all_to_all": lambda: _sequence_parallel("all_to_all"),
    "hybrid-sp2-ring_attn": lambda: _sequence_parallel("ring_attn"),
}
MODEL_OF = {"hybrid-sp2-all_to_all": "llama", "hybrid-sp2-ring_attn": "llama"}
# fp16 loss scale: 2^10 keeps every rank's scaled gradients (a quarter of
# the tokens each) inside fp16's range, as they are in the reference.
SCALE = 2.0**10
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _reference_losses(precision: str, steps: int, size: int, name: str) -> list[float]:
    model = build(name).to(DTYPES[precision])
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(masters, lr=1e-3, eps=1e-6, weight_decay=0.01)
    scale = SCALE if precision == "fp16" else 1.0
    losses = []
    for step in range(steps):
        loss = model(**batch(name, step, size=size)).loss
        (loss * scale).backward()
        grads = [p.grad.float() / scale for p in params]
        for p in params:
            p.grad = None
        losses.append(loss.item())
        if not all(torch.isfinite(g).all() for g in grads):
            scale /= 2  # overflow: skip the step, back off
            continue
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return losses


def check_precision(plugin: str, precision: str) -> None:
    if plugin == "torch-fsdp" and precision == "fp16":
        return  # refused: see check_refusals
    name = MODEL_OF.get(plugin, "gpt2")
    booster = Booster(plugin=PLUGINS[plugin](), mixed_precision=precision)
    model = build(name)
    model, optimizer, *_ = booster.boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    )
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in range(5):
        full = batch(name, step, size=2 * dp)
        loss = model(**{k: v[2 * dp_rank : 2 * dp_rank + 2] for k, v in full.items()}).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / dp)
    expected = _reference_losses(precision, 5, 2 * dp, name)
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(expected),
        rtol=TOLERANCE[precision],
        atol=0.0,
        msg=lambda m: f"{plugin} {precision}: {m} ours {losses} reference {expected}",
    )
    assert losses[-1] < losses[0]  # it trains


def check_refusals() -> None:
    model = build("gpt2")
    with pytest.raises(ValueError, match=r"tp_size \(3\) x pp_size \(1\) = 3 does not divide"):
        HybridParallelPlugin(tp_size=3)
    with pytest.raises(ValueError, match=r"ZeRO-2 shards gradients.*zero_stage=1 with pp_size=2"):
        HybridParallelPlugin(pp_size=2, zero_stage=2)
    with pytest.raises(ValueError, match=r"sequence parallelism .* set tp_size > 1"):
        HybridParallelPlugin(enable_sequence_parallelism=True)
    Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16")  # torch's AMP: accepted
    Booster(plugin=TorchFSDPPlugin(), mixed_precision="fp16")  # a loss scale over the shards
    with pytest.raises(ValueError, match=r"TorchDDPPlugin: keeps fp32 parameters.*built in bf16"):
        Booster(plugin=TorchDDPPlugin()).boost(build("gpt2").to(torch.bfloat16))
    with torch.device("meta"):
        meta = build("gpt2")
    with pytest.raises(ValueError, match=r"is on the meta device"):
        Booster(plugin=LowLevelZeroPlugin()).boost(meta, torch.optim.AdamW(meta.parameters()))
    with pytest.raises(ValueError, match=r"mixed_precision must be 'fp16', 'bf16', 'fp32' or None"):
        Booster(mixed_precision="fp8")
    with pytest.raises(ValueError, match=r"stage must be 1 or 2, got 3"):
        LowLevelZeroPlugin(stage=3)
    other = torch.optim.AdamW(build("gpt2").parameters())
    with pytest.raises(ValueError, match=r"parameters that are not the model's"):
        Booster(plugin=TorchDDPPlugin()).boost(model, other)
    with pytest.raises(ValueError, match=r"does not run pipelines"):
        Booster(plugin=TorchDDPPlugin()).execute_pipeline(iter([]), model, None)


def _steps(booster: Booster, model: object, optimizer: torch.optim.Optimizer, scheduler: object,
           steps: range) -> list[float]:  # fmt: skip
    group = booster.plugin.dp_group
    dp_rank, dp = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in steps:
        full = batch("gpt2", step, size=2 * dp)
        loss = model(**{k: v[2 * dp_rank : 2 * dp_rank + 2] for k, v in full.items()}).loss  # type: ignore[operator]
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def check_reload(plugin: str, precision: str) -> None:
    """Save and reload under mixed precision: the export holds the fp32
    masters, loading restores them exactly (not re-derived from the rounded
    parameters), the LR scheduler keeps driving the reloaded optimizer, and
    training continues exactly as without the restart."""

    def boosted(seed: int) -> tuple[Booster, object, torch.optim.Optimizer, object]:
        booster = Booster(plugin=PLUGINS[plugin](), mixed_precision=precision)
        model = build("gpt2", seed=seed)
        model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        wrapped, optimizer, _, _, scheduler = booster.boost(
            model, optimizer, lr_scheduler=scheduler
        )
        return booster, wrapped, optimizer, scheduler

    booster, model, optimizer, scheduler = boosted(0)
    _steps(booster, model, optimizer, scheduler, range(2))
    root = Path(f"/tmp/pc-booster-reload-{plugin}-{precision}")
    booster.save_model(model, root)  # type: ignore[arg-type]
    booster.save_optimizer(optimizer, root / "optimizer.pt")
    booster.save_lr_scheduler(scheduler, root / "scheduler.pt")
    saved = load_file(str(root / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in saved.values())

    again, model2, optimizer2, scheduler2 = boosted(7)
    again.load_model(model2, root)  # type: ignore[arg-type]
    state = again.plugin.model_state_dict(model2)  # type: ignore[arg-type]
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    again.load_optimizer(optimizer2, root / "optimizer.pt")
    again.load_lr_scheduler(scheduler2, root / "scheduler.pt")

    expected = _steps(booster, model, optimizer, scheduler, range(2, 4))
    losses = _steps(again, model2, optimizer2, scheduler2, range(2, 4))
    assert losses == expected, (losses, expected)
    lr = optimizer2.param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 / 5)
    inner = getattr(optimizer2, "inner", optimizer2)
    assert inner.param_groups[0]["lr"] == lr


def check_all(case: str, precision: str) -> None:
    if case.startswith("reload-"):
        check_reload(case.removeprefix("reload-"), precision)
        return
    if case == "refusals":
        if precision == "bf16":
            check_refusals()
        return
    check_precision(case, precision)


def test_mixed_precision_and_refusals() -> None:
    run_subtests(
        check_all,
        4,
        {
            "case": [
                *PLUGINS,
                "refusals",
                "reload-zero1",
                "reload-gemini",
                "reload-hybrid-tp2-zero1",
            ],
            "precision": ["bf16", "fp16"],
        },
        timeout=540,
    )
