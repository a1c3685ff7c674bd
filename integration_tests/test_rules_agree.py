"""The API, pc-train and pc-estimate accept and refuse exactly the same
combinations [Note: one place for every rule]: the API's verdict is taken
from a real process group (plugin constructor, Booster, boost, no_sync;
packages/pc-booster/tests/plugin_matrix.py), pc-train's from ``prepare``
(its preflight, before any process starts) and pc-estimate's from its
exit status, over every combination pc-train can express.
``PC_PLUGIN_MATRIX=full`` also varies the tensor x pipeline layouts fully
(the default runs a sample of them)."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/pc-booster/tests"))
from plugin_matrix import (  # type: ignore[import-not-found]
    HYBRID_LAYOUTS,
    MAX_NORM,
    WORLD,
    Case,
    verdict_rows,
)

from pc_train.estimate import main as estimate_main
from pc_train.train import prepare
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(1800)

TRAIN_PLUGIN = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "torch-fsdp": "fsdp",
    "gemini": "gemini",
    "gemini-step-in-backward": "gemini",
    "hybrid": "hybrid",
}
SAMPLE_LAYOUTS = [(2, 1, 0), (2, 1, 2), (1, 2, 0), (1, 2, 1), (1, 2, 2), (2, 2, 1)]


def cases() -> list[Case]:
    full = os.environ.get("PC_PLUGIN_MATRIX") == "full"
    layouts = sorted({(tp, pp, zero) for tp, pp, zero, _ in HYBRID_LAYOUTS})
    out = []
    for plugin in TRAIN_PLUGIN:
        plugin_layouts = (
            (layouts if full else SAMPLE_LAYOUTS) if plugin == "hybrid" else [(1, 1, 0)]
        )
        for (tp, pp, zero), precision, clip, accumulation in itertools.product(
            plugin_layouts, ("fp32", "bf16", "fp16"), (False, True), (1, 2)
        ):
            out.append(Case(plugin, precision, clip, accumulation, False, "fp32", tp, pp, zero))
    return out


def train_verdict(case: Case) -> str | None:
    """pc-train's preflight on the case: None if accepted, else the error."""
    config = TrainConfig(
        model="gpt2-small",  # 4 blocks of 4 heads, as the matrix's model
        plugin=TRAIN_PLUGIN[case.plugin],
        precision=case.precision,
        clip_norm=MAX_NORM if case.clip else 0.0,
        accumulation=case.accumulation,
        global_batch_size=16,
        tp=case.tp,
        pp=case.pp,
        zero_stage=case.zero if case.plugin == "hybrid" else 1,
        microbatches=2 if case.plugin == "hybrid" and case.pp > 1 else None,
        step_in_backward=case.plugin == "gemini-step-in-backward",
        nproc=WORLD,
    )
    try:
        prepare(config, WORLD)
    except ValueError as error:
        return str(error)
    return None


def estimate_verdict(case: Case) -> str | None:
    """pc-estimate's exit on the case (it has no clipping or accumulation
    flags: only cases without them): None if it succeeds, else its error."""
    argv = [
        "--model", "gpt2-small", "--world", str(WORLD), "--precision", case.precision,
        "--plugin", TRAIN_PLUGIN[case.plugin], "--tp", str(case.tp), "--pp", str(case.pp),
        "--zero-stage", str(case.zero if case.plugin == "hybrid" else 1), "--json",
        "--device-memory-gib", "64",
    ]  # fmt: skip
    if case.plugin == "gemini-step-in-backward":
        argv.append("--step-in-backward")
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            estimate_main(argv)
    except SystemExit as exit:
        return err.getvalue().strip() or f"exit {exit.code}"
    return None


def test_api_pc_train_and_pc_estimate_agree(tmp_path: Path) -> None:
    all_cases = cases()
    rows = verdict_rows(all_cases, tmp_path / "verdicts.json")
    assert len(rows) == len(all_cases)
    disagreements = []
    for case, row in zip(all_cases, rows, strict=True):
        api = row["reason"]
        tools = {"pc-train": train_verdict(case)}
        if not case.clip and case.accumulation == 1:
            tools["pc-estimate"] = estimate_verdict(case)
        for tool, theirs in tools.items():
            if (api is None) != (theirs is None):
                disagreements.append(f"{case.label()}: API {api!r}, {tool} {theirs!r}")
    assert not disagreements, "\n".join(disagreements)
    refused = sum(row["reason"] is not None for row in rows)
    assert 0 < refused < len(rows), refused  # both verdicts occur
