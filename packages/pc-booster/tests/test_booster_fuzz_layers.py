"""Configuration fuzzing of the pipeline wrappers (partition, GPipe,
PipeDream, ZeroBubble, Interleaved1F1B) and the tensor-parallel layers
(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding). Any
option values either build something that runs or raise ValueError /
TypeError with a message; never another exception, never a hang. One
process, a gloo group of one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pc_comm.testing import one_process_group
from pc_pipeline import GPipe, Interleaved1F1B, PipeDream, ZeroBubble, partition
from pc_tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

pytestmark = pytest.mark.timeout(300)

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 9),
    st.sampled_from([0, 2**20, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-1, 4), max_size=5),
)
FAST = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module", autouse=True)
def _group() -> Iterator[None]:
    with one_process_group():
        yield


def _clear(error: Exception, what: str) -> None:
    assert isinstance(error, ValueError | TypeError), f"{what}: {error!r}"
    assert len(str(error)) > 20, f"{what}: {error!r}"


def _try(what: str, build: Callable[[], Any], run: Callable[[Any], None]) -> None:
    try:
        built = build()
    except Exception as error:
        _clear(error, what)
        return
    run(built)  # it built: it must also run


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _options(names: list[str]) -> Any:
    return st.dictionaries(st.sampled_from(names), ANY, max_size=3)


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))


@FAST
@given(ANY, ANY, _options(["num_model_chunks", "balance", "costs"]))
def test_partition_options(rank: Any, world: Any, options: dict[str, Any]) -> None:
    def run(stages: Any) -> None:
        for stage in stages if isinstance(stages, list) else [stages]:
            stage(torch.randn(2, 6))

    _try(f"partition(rank={rank!r}, world={world!r}, {options})",
         lambda: partition(_blocks(), rank, world, **options), run)  # fmt: skip


def _run_pipeline(pipe: Any) -> None:
    batch = torch.randn(4 * pipe.chunks, 6)
    pipe.forward_backward(batch, criterion=lambda out: out.sum())


@FAST
@given(
    st.sampled_from([GPipe, PipeDream, ZeroBubble]),
    ANY,
    _options(["checkpoint", "timeout"]),
)
def test_pipeline_wrapper_options(kind: Any, chunks: Any, options: dict[str, Any]) -> None:
    _try(f"{kind.__name__}(chunks={chunks!r}, {options})",
         lambda: kind(_blocks(), chunks, **options), _run_pipeline)  # fmt: skip


@FAST
@given(ANY, ANY, _options(["checkpoint", "timeout"]))
def test_interleaved_options(model_chunks: Any, chunks: Any, options: dict[str, Any]) -> None:
    def build() -> Any:
        stages: Any = partition(_blocks(), 0, 1, num_model_chunks=model_chunks)
        return Interleaved1F1B(stages, chunks, **options)

    _try(f"Interleaved1F1B(v={model_chunks!r}, chunks={chunks!r}, {options})", build,
         _run_pipeline)  # fmt: skip


LINEAR_OPTIONS: dict[type[nn.Module], list[str]] = {
    ColumnParallelLinear: ["gather_output", "sequence_parallel", "input_gathered",
                           "sequence_dim", "parts", "valid_out_features"],
    RowParallelLinear: ["input_is_parallel", "sequence_parallel", "sequence_dim"],
}  # fmt: skip


@pytest.mark.parametrize("kind", list(LINEAR_OPTIONS), ids=lambda kind: kind.__name__)
def test_parallel_linear_options(kind: Any) -> None:
    layer = nn.Linear(8, 12)

    def run(built: Any) -> None:
        built(torch.randn(2, 3, 8)).sum().backward()

    @FAST
    @given(_options(LINEAR_OPTIONS[kind]))
    def check(options: dict[str, Any]) -> None:
        _try(f"{kind.__name__}({options})",
             lambda: kind(layer.weight, layer.bias, _world(), **options), run)  # fmt: skip

    check()


@FAST
@given(_options(["padded_size", "padding_idx"]))
def test_vocab_parallel_embedding_options(options: dict[str, Any]) -> None:
    table = nn.Embedding(10, 4)

    def run(built: Any) -> None:
        built(torch.tensor([[0, 3, 9]])).sum().backward()

    _try(f"VocabParallelEmbedding({options})",
         lambda: VocabParallelEmbedding(table.weight, _world(), **options),
         run)  # fmt: skip
