"""A sample of the plan sweep (``sweep.py``) in ``nox -s tests``: families
chosen for their different shapes, each trained 3 steps under tensor
parallelism 2, with sequence parallelism, in a 2-stage pipeline, with
their classification heads and (MoE families) with expert parallelism 2,
against single-process training; tp 2 x pp 2
at world 4 on three of them. The whole sweep is ``nox -s plans``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import sweep

pytestmark = pytest.mark.timeout(900)

# family -> what each mode must give ("pass" or the refusal's words)
SAMPLE: dict[str, dict[str, str]] = {
    "llama": {},  # grouped-query attention, gated MLP
    "llama+tied": {},  # LM head tied to the embedding: split together, across stages
    "llama+gqa1": {  # one key/value head: tp 2 refuses it, a pipeline does not care
        "tp": "num_key_value_heads = 1 is not divisible",
        "sp": "not divisible",
        "cls": "not divisible",
    },
    "qwen2": {},  # query/key/value biases
    "qwen3": {},  # per-head q/k norms (gradients summed over the group)
    "phi3": {},  # packed qkv and gate_up, outputs gathered, inputs split
    "olmo2": {},  # norms over the whole query (gathered outputs)
    "gpt_neox": {},  # interleaved packed qkv, parallel attention + MLP
    "cohere": {},  # parallel block, scaled logits
    "gemma3_text": {},  # scaled embedding, sliding-window layers, per-head norms
    "starcoder2": {},  # biases everywhere, plain MLP
    "apertus": {},  # a learned activation inside the split MLP
    # Families without a plan: pc's inferred plan and module-tree cut.
    "opt": {},  # the blocks under model.decoder, a final norm outside them
    "electra": {},  # embeddings narrower than the blocks, projected to them
    "mixtral": {  # MoE: tensor parallelism refuses it, a pipeline and ep 2 train it
        "tp": "mixture-of-experts",
        "sp": "mixture-of-experts",
        "cls": "mixture-of-experts",
    },
}


# Expert parallelism (ep) is for mixture-of-experts families; the others skip it.
MOE_FAMILIES = {"mixtral"}


def _expect(row: dict[str, str], family: str, modes: tuple[str, ...]) -> None:
    for mode in modes:
        dense = mode == "ep" and family not in MOE_FAMILIES
        want = SAMPLE[family].get(mode, "dense" if dense else "pass")
        got = row[mode]
        if want == "dense":
            assert got.startswith("skip: not a mixture-of-experts"), f"{family} {mode}: {got}"
        elif want == "pass":
            assert got.startswith(("pass", "skip: no sequence")), f"{family} {mode}: {got}"
        else:
            assert got.startswith("refused"), f"{family} {mode}: {got}"
            assert want in got, f"{family} {mode}: {got}"


def test_plan_sample_at_world_2() -> None:
    rows = sweep.sweep(list(SAMPLE), sweep.EP_MODES)
    assert [r["family"] for r in rows] == list(SAMPLE)
    for row in rows:
        _expect(row, row["family"], sweep.EP_MODES)


def test_plan_sample_tp2_pp2_at_world_4() -> None:
    sample = ["llama+tied", "phi3", "gpt_neox"]
    for row in sweep.sweep(sample, ("tp-pp",), world=4):
        _expect(row, row["family"], ("tp-pp",))
