"""Configuration fuzzing of pc-train: any value for its settings, and any
plugin flags against any layout, either works or raises ValueError /
TypeError with a message; never another exception. (No process group:
these are the checks made before any process starts. The plugins' own
constructor options: packages/pc-booster/tests/test_booster_fuzz.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_train.options import PLUGIN_NAMES, PRECISIONS, PluginOptions
from pc_train.train_config import TrainConfig

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["1f1b", "zbv", "interleaved", "static", "auto", "fp16", "bf16"]),
)


def _clear(error: Exception) -> None:
    assert isinstance(error, ValueError | TypeError), repr(error)
    assert len(str(error)) > 20, repr(error)  # a sentence, not a bare value


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    plugin=st.sampled_from(PLUGIN_NAMES),
    precision=st.sampled_from([*PRECISIONS, "fp8"]),
    world=st.integers(1, 16),
    tp=st.integers(-1, 8),
    pp=st.integers(-1, 8),
    zero_stage=st.integers(-1, 3),
    layers=st.integers(1, 12),
    offload=st.floats(-1, 2),
    sp=st.booleans(),
    clip=st.sampled_from([0.0, 1.0]),
)
def test_layouts_fail_only_with_clear_errors(
    plugin: str, precision: str, world: int, tp: int, pp: int, zero_stage: int, layers: int,
    offload: float, sp: bool, clip: float,
) -> None:  # fmt: skip
    try:
        options = PluginOptions.parse(
            plugin if plugin != "auto" else "zero2",
            tp=tp, pp=pp, zero_stage=zero_stage, offload_frac=offload, sequence_parallel=sp,
        )  # fmt: skip
        options.check(world, precision, layers)
        options.make(clip)
    except Exception as error:
        _clear(error)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(sorted(TrainConfig.__dataclass_fields__)), ANY, max_size=4))
def test_train_settings_fail_only_with_clear_errors(settings_: dict[str, Any]) -> None:
    try:
        TrainConfig(**settings_)
    except Exception as error:
        _clear(error)


def test_a_clear_error_is_a_sentence() -> None:
    with pytest.raises(AssertionError):
        _clear(KeyError("x"))
