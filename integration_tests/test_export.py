"""Export without gathering ([Note: streamed export] in pc_booster.checkpoint.export):
a GPT-2 of about 50 MiB of fp32 parameters, saved sharded under ZeRO-2 at
world 2, becomes a transformers directory with ``pc-export`` whose peak
memory grows by less than 2 x ``size_per_shard`` over the same command on
a tiny checkpoint; ``from_pretrained`` loads it with the trained model's
logits; ``Booster.export_pretrained`` writes the same files from a running
job; ``pc-export --to-sharded`` turns it back into a sharded checkpoint
that loads under Gemini with the same values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(600)

SIZE_PER_SHARD = 4  # MiB; the largest tensor (c_fc, 512 x 2048 fp32) is 4 MiB


def _gpt2(width: int, layers: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=width, n_layer=layers, n_head=4)
    return GPT2LMHeadModel(config)


def _save(root: str, width: int, layers: int, name: str) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    model = _gpt2(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    booster.save_model(model, Path(root) / name / "sharded", shard=True)
    booster.export_pretrained(model, Path(root) / name / "online", size_per_shard=SIZE_PER_SHARD)
    if dist.get_rank() == 0:
        state = booster.plugin.model_state_dict(model)
        torch.save(state, Path(root) / name / "expected.pt")
    dist.barrier()


def _load_under_gemini(root: str) -> None:
    booster = Booster(plugin=GeminiPlugin())
    model = _gpt2(512, 4)
    torch.manual_seed(9)
    for p in model.parameters():  # other values: the load must replace them
        p.data.normal_()
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    booster.load_model(model, Path(root) / "big" / "resharded")
    expected = torch.load(Path(root) / "big" / "expected.pt")
    state = booster.plugin.model_state_dict(model)
    for key, value in expected.items():
        torch.testing.assert_close(state[key].float(), value.float(), rtol=0, atol=0)


_PEAK = (
    "import resource, runpy, sys; sys.argv = ['pc-export', *sys.argv[1:]];"
    "runpy.run_module('pc_train.export', run_name='__main__');"
    "print('peak-kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
)


def _export(*args: str) -> int:
    """Run pc-export; its peak resident memory in KiB."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split("peak-kib")[-1])


def test_export_streams_and_round_trips(tmp_path: Path) -> None:
    # The baseline, the same command on a tiny model, counts what does not
    # grow with the model (imports, DCP's own structures).
    run_subtests(_save_both, 2, {}, args=(str(tmp_path),), timeout=300)
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    shard = str(SIZE_PER_SHARD)
    base = _export(str(tiny / "sharded"), str(tiny / "offline"), "--size-per-shard", shard)
    peak = _export(str(big / "sharded"), str(big / "offline"), "--size-per-shard", shard)
    total = sum(v.numel() * 4 for v in torch.load(big / "expected.pt").values()) / 2**20
    assert total > 12 * SIZE_PER_SHARD, total  # gathering would show
    grown = (peak - base) / 1024
    print(f"pc-export: {total:.0f} MiB of parameters, peak {grown:.1f} MiB over a tiny model's")
    assert grown < 2 * SIZE_PER_SHARD + 8, f"pc-export grew by {grown:.1f} MiB ({total:.0f} MiB)"

    index = json.loads((big / "offline" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 12, files
    for file in files:  # each at most size_per_shard, or one tensor alone
        assert (big / "offline" / file).stat().st_size <= SIZE_PER_SHARD * 2**20 + 4096
    expected = torch.load(big / "expected.pt")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(5))
    reference = _gpt2(512, 4).eval()  # from_pretrained gives eval mode (no dropout)
    reference.load_state_dict(expected, strict=False)
    with torch.no_grad():
        logits = reference(ids).logits
        for form in ("offline", "online"):
            loaded = GPT2LMHeadModel.from_pretrained(big / form)
            torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=0)

    _export(str(big / "offline"), str(big / "resharded"), "--to-sharded")
    run_subtests(_load_under_gemini, 2, {}, args=(str(tmp_path),), timeout=300)


def _save_both(root: str) -> None:
    _save(root, 512, 4, "big")
    _save(root, 32, 1, "tiny")
