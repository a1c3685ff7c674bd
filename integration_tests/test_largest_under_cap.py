"""Under one memory cap on a whole 2-rank job, the largest Llama of one
shape family that trains grows with each optimizer-state tier: Gemini
stepping in backward at least FSDP2 + CPUOffloadPolicy's, more with bf16
moments, and more again with the moments on the NVMe tier, there at least
twice FSDP2's [issue 56].

benchmarks/bench_largest_under_cap.py owns the measurement (the model
family, the cap, the search); this test runs its search at a smaller cap
and fewer steps than the recorded run, so that it takes minutes. Run by
``nox -s scale`` (cgroup v1, as root)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_largest_under_cap import best, largest, parameters_of
from memory_cap import unavailable

pytestmark = [
    pytest.mark.scale,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(unavailable() is not None, reason=f"memory caps: {unavailable()}"),
]

CAP_GIB = 2.0
STEPS = 3


def test_the_largest_model_grows_with_each_tier(tmp_path: Path) -> None:
    found: dict[str, int] = {}
    start = 10
    for layout in ("fsdp2-offload", "gemini", "gemini-bf16", "gemini-nvme"):
        fit = best(largest(layout, start, CAP_GIB, STEPS, str(tmp_path)))
        assert fit is not None, f"{layout}: no size fits {CAP_GIB} GiB"
        found[layout] = parameters_of(fit.k)
        start = fit.k
    millions = {k: f"{v / 1e6:.0f} M" for k, v in found.items()}
    assert found["gemini"] >= found["fsdp2-offload"], millions
    assert found["gemini-bf16"] > found["gemini"], millions
    assert found["gemini-nvme"] > found["gemini-bf16"], millions
    assert found["gemini-nvme"] >= 2 * found["fsdp2-offload"], millions
