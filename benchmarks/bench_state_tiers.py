"""Host bytes per parameter with the optimizer states in fp32, bf16, 8 bits
and on the NVMe tier, Gemini stepping in backward, 2 ranks [issue 56].

A Llama (hidden 512, intermediate 1536, vocab 8000) built lazily at 4 and
at 16 layers (3.1 M parameters a layer), fp32, AdamW through
pc_offload.HybridAdam with ``state_dtype`` fp32 / bf16 / int8, and fp32
moments on the disk tier (``nvme_offload_fraction=1.0``), 3 steps of
2 x 64 tokens per rank. Counted from outside, per rank: the process's
anonymous resident memory (RssAnon, /proc/self/status: not the page cache
of the tier's file, which the kernel writes back and reclaims), its peak
through each phase (build, each step), sampled every 5 ms. What the 12
layers added over the 4 divided by their parameters is the bytes per
parameter a rank holds, without what every process holds whatever the
model (torch, transformers, thread pools): the largest rank's. The ranks
give freed blocks back to the system (pc_comm's [Note: host allocator]).

    python benchmarks/bench_state_tiers.py
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import tune_host_allocator
from pc_comm.host_allocator import HostAllocatorSettings
from pc_comm.testing import spawn

ROWS: dict[str, dict[str, Any]] = {
    "fp32 states": {"state_dtype": "fp32"},
    "bf16 states": {"state_dtype": "bf16"},
    "int8 states": {"state_dtype": "int8"},
    "fp32 states on NVMe": {"state_dtype": "fp32", "nvme_offload_fraction": 1.0},
}


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The largest RssAnon seen, sampled every 5 ms."""

    def __init__(self) -> None:
        self.value = rss_anon()
        self._stop = False
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop:
            self.value = max(self.value, rss_anon())
            time.sleep(0.005)

    def take(self) -> int:
        value, self.value = max(self.value, rss_anon()), rss_anon()
        return value


def _llama(layers: int) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def measure(out: str, row: str, scratch: str, layers: int) -> None:
    from pc_booster import Booster, GeminiPlugin
    from pc_chunk import LazyInitContext
    from pc_offload import HybridAdam

    tune_host_allocator(HostAllocatorSettings(mmap_threshold=1 << 20))
    _llama(1)  # transformers' modules imported before the count starts
    base = rss_anon()
    peak = _Peak()
    with LazyInitContext():
        model = _llama(layers)
    params = sum(p.numel() for p in model.parameters())
    options = dict(ROWS[row])
    optimizer = HybridAdam(model.parameters(), lr=1e-4, nvme_offload_dir=scratch, **options)
    booster = Booster(plugin=GeminiPlugin(step_in_backward=True, search_range_m=4,
                                          min_chunk_size_m=2))  # fmt: skip
    model, optimizer, *_ = booster.boost(model, optimizer)
    phases = {"build": float(peak.take() - base)}
    for step in range(3):
        ids = torch.randint(0, 8000, (1, 8), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        phases[f"step {step + 1}"] = float(peak.take() - base)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, phases)
    if dist.get_rank() == 0:
        worst = {k: max(g[k] for g in gathered) for k in phases}
        Path(out).write_text(json.dumps({"params": params, "phases": worst}))


def run(row: str, layers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "out.json")
        spawn(measure, 2, args=(out, row, folder, layers), timeout=900)
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def per_parameter(row: str) -> dict[str, float]:
    """Bytes per parameter by phase: what 12 more layers added, over their
    parameters."""
    small, large = run(row, 4), run(row, 16)
    added = large["params"] - small["params"]
    return {k: (large["phases"][k] - small["phases"][k]) / added for k in large["phases"]}


def main() -> None:
    print("Llama (hidden 512), Gemini stepping in backward, 2 ranks: peak anonymous")
    print("host bytes per parameter a rank holds, largest rank, by phase:")
    for row in ROWS:
        phases = "  ".join(f"{k} {v:5.2f}" for k, v in per_parameter(row).items())
        print(f"  {row:22s} {phases}", flush=True)


if __name__ == "__main__":
    main()
