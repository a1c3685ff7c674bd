"""Configuration fuzzing of the wrappers under the plugins: pc-comm's
DistributedDataParallel, pc-zero's LowLevelZeroOptimizer,
FullyShardedDataParallel and GeminiDDP, pc-offload's CPUOffload. Any
option values either construct a working wrapper or raise ValueError /
TypeError with a message; never another exception, never a hang. One
process, a gloo group of one (the option checks come before any
communication)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pc_comm import DistributedDataParallel
from pc_comm.testing import one_process_group
from pc_offload import CPUOffload
from pc_zero import FullyShardedDataParallel, GeminiDDP, LowLevelZeroOptimizer

pytestmark = pytest.mark.timeout(300)

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.sampled_from([0, 1024, 2**20, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.sampled_from(["static", "auto", "cuda", "cpu"]),
)


@pytest.fixture(scope="module", autouse=True)
def _group() -> Iterator[None]:
    with one_process_group():
        yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _clear(error: Exception, what: str) -> None:
    assert isinstance(error, ValueError | TypeError), f"{what}: {error!r}"
    assert len(str(error)) > 20, f"{what}: {error!r}"


def _try(what: str, build: Callable[[], Any]) -> None:
    try:
        built = build()
    except Exception as error:
        _clear(error, what)
        return
    if isinstance(built, nn.Module):  # it built: it must also run
        x = torch.randn(2, 8)
        built(x).sum().backward()


def _options(names: list[str]) -> Any:
    return st.dictionaries(st.sampled_from(names), ANY, max_size=3)


# derandomize: the same examples every run, so CI is reproducible (a new
# seed is one `--hypothesis-seed=N` away when hunting).
FAST = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@FAST
@given(_options(["bucket_cap_mb", "find_unused_parameters", "broadcast_buffers",
                 "gradient_as_bucket_view"]))  # fmt: skip
def test_ddp_options(options: dict[str, Any]) -> None:
    _try(
        f"DistributedDataParallel({options})", lambda: DistributedDataParallel(_model(), **options)
    )


@FAST
@given(_options(["stage", "reduce_bucket_size", "overlap_communication", "max_norm",
                 "cpu_offload", "partition_grad"]))  # fmt: skip
def test_low_level_zero_options(options: dict[str, Any]) -> None:
    def build() -> Any:
        model = _model()
        return LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), **options)

    _try(f"LowLevelZeroOptimizer({options})", build)


@FAST
@given(_options(["reshard_after_forward", "offload_params", "sync_module_states",
                 "forward_prefetch", "device"]))  # fmt: skip
def test_fsdp_options(options: dict[str, Any]) -> None:
    _try(f"FullyShardedDataParallel({options})",
         lambda: FullyShardedDataParallel(_model(), **options))  # fmt: skip


@FAST
@given(_options(["placement_policy", "offload_param_frac", "device_budget_bytes", "chunk_size",
                 "search_range", "min_chunk_size", "sync_module_states", "prefetch"]))  # fmt: skip
def test_gemini_options(options: dict[str, Any]) -> None:
    _try(f"GeminiDDP({options})", lambda: GeminiDDP(_model(), **options))


@FAST
@given(_options(["offload_ratio", "tag", "enable", "min_bytes"]))
def test_cpu_offload_options(options: dict[str, Any]) -> None:
    def build() -> None:
        model = _model()
        with CPUOffload(**options):
            loss = model(torch.randn(2, 8)).sum()
        loss.backward()

    _try(f"CPUOffload({options})", build)
