"""Configuration fuzzing: any value for the plugins' constructor options
either works or raises ValueError / TypeError with a message; never another
exception. (No process group: these are the checks made before any process
starts. pc-train's settings and plugin flags: packages/pc-train/tests/test_train_fuzz.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_booster import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

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


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from([LowLevelZeroPlugin, GeminiPlugin, HybridParallelPlugin]),
    options=st.dictionaries(
        st.sampled_from(
            [
                "stage",
                "tp_size",
                "pp_size",
                "zero_stage",
                "pp_style",
                "num_microbatches",
                "enable_sequence_parallelism",
                "max_norm",
                "placement_policy",
                "offload_param_frac",
                "initial_scale",
                "growth_interval",
                "hysteresis",
                "pp_timeout",
                "cpu_offload",
            ]
        ),
        ANY,
        max_size=4,
    ),
)
def test_plugin_options_fail_only_with_clear_errors(kind: Any, options: dict[str, Any]) -> None:
    try:
        kind(**options)
    except Exception as error:
        _clear(error)


def test_a_clear_error_is_a_sentence() -> None:
    with pytest.raises(AssertionError):
        _clear(KeyError("x"))
