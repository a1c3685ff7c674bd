"""pc-chunk's chunk-size search on models with thousands of parameters.

Colossal-AI's search (the only peer) is not installable here, so this
reports our time alone, for three parameter-size mixes: GPT-2-like
(3,000 tensors), LLaMA-like (10,000) and many small tensors (20,000).

    python benchmarks/bench_chunk.py
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from pc_chunk import packing_waste, search_chunk_size

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
MiB = 1024 * 1024


def _mix(name: str) -> list[int]:
    rng = random.Random(0)
    if name == "gpt2-like":
        choices = [768 * 768, 768 * 3072, 768, 3072, 50257 * 768]
        return [rng.choice(choices) for _ in range(3000)]
    if name == "llama-like":
        choices = [4096 * 4096, 4096 * 11008, 4096]
        return [rng.choice(choices) for _ in range(10000)]
    return [rng.randint(1, 100_000) for _ in range(20000)]


def main() -> None:
    rows = []
    for name, search_range, minimum in [
        ("gpt2-like", 64 * MiB, 32 * MiB),
        ("llama-like", 128 * MiB, 64 * MiB),
        ("small-tensors", 8 * MiB, 1 * MiB),
    ]:
        sizes = _mix(name)
        minimum = max(minimum, max(sizes))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = search_chunk_size(sizes, search_range, minimum, 1024)
            times.append(time.perf_counter() - start)
        assert result.waste == packing_waste(sizes, result.chunk_size)[1]
        rows.append(
            {
                "mix": name,
                "tensors": len(sizes),
                "seconds": statistics.median(times),
                "chunk_size": result.chunk_size,
                "waste_fraction": result.waste / (result.num_chunks * result.chunk_size),
            }
        )
        print(
            f"{name:14s} {len(sizes):6d} tensors  {statistics.median(times) * 1000:8.1f} ms"
            f"  chunk {result.chunk_size / MiB:7.2f} Mi elements"
            f"  waste {rows[-1]['waste_fraction']:.2%}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chunk.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
