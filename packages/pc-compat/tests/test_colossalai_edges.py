"""What the Colossal-AI edge honours without a process group: the
schedulers' values step by step (from their formulas), FusedAdam / FusedSGD
against torch's optimizers, HybridAdam's ``model_params`` keyword,
``GeneralCheckpointIO`` round trips that never run code from a file,
``LazyInitContext(default_device=)``, ``launch``'s backend on a CPU
machine, and the plugins' Colossal-AI defaults."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pc_booster.rules import TrainPrecision
from pc_compat.colossalai._launch import _backend
from pc_compat.colossalai.checkpoint_io import GeneralCheckpointIO
from pc_compat.colossalai.lazy import LazyInitContext
from pc_compat.colossalai.nn import lr_scheduler as schedules
from pc_compat.colossalai.nn.optimizer import FusedAdam, FusedSGD, HybridAdam


def _lrs(make: Any, steps: int) -> list[float]:
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


def _close(ours: list[float], want: list[float]) -> None:
    assert ours == pytest.approx(want, rel=1e-12, abs=1e-12), (ours, want)


def test_flat_annealing_holds_then_anneals() -> None:
    total, flat = 10, int(10 * 0.5)
    want = [1.0] * flat + [(1 + math.cos(math.pi * k / (total - flat))) / 2 for k in range(5)]
    _close(_lrs(lambda o: schedules.FlatAnnealingLR(o, total, pct_start=0.5), total), want)


def test_flat_annealing_warmup_warms_holds_then_anneals() -> None:
    total, warmup, eta = 12, 2, 0.1
    flat = int((total - warmup) * 0.5)
    anneal = total - warmup - flat
    want = [1 / 2, 2 / 2] + [1.0] * flat
    want += [eta + (1 - eta) * (1 + math.cos(math.pi * k / anneal)) / 2 for k in range(anneal)]
    make = lambda o: schedules.FlatAnnealingWarmupLR(  # noqa: E731
        o, total, warmup_steps=warmup, pct_start=0.5, eta_min=eta
    )
    _close(_lrs(make, total), want)


def test_multistep_warmup_counts_milestones_from_the_start() -> None:
    make = lambda o: schedules.MultiStepWarmupLR(  # noqa: E731
        o, 10, warmup_steps=2, milestones=[1, 4, 7], gamma=0.5
    )
    # milestone 1 lies inside the warmup and is dropped, as in Colossal-AI
    _close(_lrs(make, 9), [0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match="milestones must name at least one step"):
        _lrs(lambda o: schedules.MultiStepWarmupLR(o, 10, milestones=[]), 1)


def test_torch_shaped_schedules_take_total_steps_first() -> None:
    _close(_lrs(lambda o: schedules.StepLR(o, 100, step_size=2, gamma=0.5), 5),
           [1.0, 1.0, 0.5, 0.5, 0.25])  # fmt: skip
    _close(_lrs(lambda o: schedules.ExponentialLR(o, 100, gamma=0.5), 3), [1.0, 0.5, 0.25])
    _close(_lrs(lambda o: schedules.LambdaLR(o, 100, lr_lambda=lambda k: 1 / (k + 1)), 3),
           [1.0, 1 / 2, 1 / 3])  # fmt: skip
    _close(_lrs(lambda o: schedules.MultiplicativeLR(o, 100, lr_lambda=lambda k: 0.5), 3),
           [1.0, 0.5, 0.25])  # fmt: skip
    with pytest.raises(ValueError, match="lr_lambda is required"):
        _lrs(lambda o: schedules.LambdaLR(o, 100), 1)
    # Colossal-AI's schedulers swallow extra keywords; so do these
    _lrs(lambda o: schedules.CosineAnnealingLR(o, 10, warmup_steps=3), 1)


def _train(optimizer_of: Any, steps: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = optimizer_of(model.parameters())
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_training(ours: Any, want: Any) -> None:
    a, b = _train(ours), _train(want)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def test_fused_adam_is_torchs_adamw_or_adam() -> None:
    _same_training(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))  # fmt: skip
    _same_training(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adamw_mode=False),
                   lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1))  # fmt: skip
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam([nn.Parameter(torch.zeros(1))], bias_correction=False)


def test_fused_sgd_is_torchs_sgd() -> None:
    _same_training(
        lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    )
    with pytest.raises(ValueError, match="wd_after_momentum=True"):
        FusedSGD([nn.Parameter(torch.zeros(1))], lr=0.1, wd_after_momentum=True)


def test_hybrid_adam_takes_model_params_by_keyword() -> None:
    _same_training(lambda p: HybridAdam(model_params=p, lr=1e-2),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword"):
        HybridAdam(model_params=[nn.Parameter(torch.zeros(1))], bogus=1)


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("ran code from a checkpoint",))


def test_general_checkpoint_io_round_trips_and_runs_no_code(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for name in ("model.pt", "model.safetensors"):
        io.save_model(model, tmp_path / name)
        twin = nn.Linear(3, 2)
        io.load_model(twin, tmp_path / name)
        torch.testing.assert_close(twin.state_dict(), model.state_dict())
    io.save_optimizer(optimizer, tmp_path / "optimizer.pt")
    other = torch.optim.AdamW(nn.Linear(3, 2).parameters(), lr=0.5)
    io.load_optimizer(other, tmp_path / "optimizer.pt")
    assert other.param_groups[0]["lr"] == 0.1
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"weight": _Payload()}))
    with pytest.raises(pickle.UnpicklingError):
        io.load_model(nn.Linear(3, 2), tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="sharded and async saves are the Booster's"):
        io.save_model(model, tmp_path / "m.pt", shard=True)


def test_lazy_init_context_takes_default_device() -> None:
    from pc_chunk import is_lazy

    with LazyInitContext(default_device="cpu"):
        model = nn.Linear(4, 4)
    assert is_lazy(model.weight)
    with pytest.raises(RuntimeError):
        LazyInitContext(default_device="not-a-device")


def test_nccl_falls_back_to_gloo_without_a_gpu() -> None:
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert _backend("nccl") == expected
    assert _backend("gloo") == "gloo"


def test_plugins_take_colossalais_defaults() -> None:
    from pc_compat.colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin

    zero = LowLevelZeroPlugin()
    assert zero.precision is not None
    assert zero.precision.value == "fp16"
    assert zero.options.initial_scale == 2**32
    assert zero.options.reduce_bucket_size_in_m == 12
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        LowLevelZeroPlugin(bogus=1)
    # pc's own options stay reachable, after the original's
    assert LowLevelZeroPlugin(stage=2, precision="fp32").precision is TrainPrecision.FP32
    assert HybridParallelPlugin.__init__.__signature__.parameters["precision"].default == "fp16"  # type: ignore[attr-defined]


def test_booster_refuses_a_plugin_in_the_device_place() -> None:
    from pc_booster import TorchDDPPlugin
    from pc_compat.colossalai.booster import Booster

    with pytest.raises(TypeError, match=r"pass the plugin by name, Booster\(plugin=...\)"):
        Booster(TorchDDPPlugin.__new__(TorchDDPPlugin))  # type: ignore[arg-type]


def test_launchers_read_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from pc_compat import colossalai

    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(ValueError, match="SLURM_PROCID, SLURM_NPROCS not set"):
        colossalai.launch_from_slurm(host="127.0.0.1", port=29500)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    with pytest.raises(ValueError, match="not started by openmpi"):
        colossalai.launch_from_openmpi(host="127.0.0.1", port=29500)
    assert colossalai.__version__ == "0.5.0"


def test_linear_warmup_longer_than_the_run_warms_up() -> None:
    # Colossal-AI's mixed-precision page builds one with warmup_steps=50 for a 2-step run.
    _close(_lrs(lambda o: schedules.LinearWarmupLR(o, 2, warmup_steps=4), 3), [0.2, 0.4, 0.6])
