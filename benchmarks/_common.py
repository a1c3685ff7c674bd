"""What every benchmark shares: alternating timing and the GPT-2 models."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import tiny_gpt2


def alternate(
    fns: Mapping[str, Callable[[], object]], iters: int, *, reps: int = 1, sync: bool = False
) -> dict[str, list[float]]:
    """Seconds per call of each function, ``iters`` samples each. The order
    flips every round so drift on a shared machine hits every side alike;
    each sample times ``reps`` back-to-back calls; ``sync`` starts every
    sample on all ranks together."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(iters):
        for name in names if i % 2 == 0 else reversed(names):
            if sync:
                dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                fns[name]()
            samples[name].append((time.perf_counter() - start) / reps)
    return samples


def median_max(samples: list[float]) -> float:
    """The median of this rank's samples, then the slowest rank's."""
    value = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def gpt2(vocab_size: int, positions: int, width: int, layers: int, heads: int) -> nn.Module:
    """A GPT-2 with the library's default dropout, seeded, for timing."""
    torch.manual_seed(0)
    return tiny_gpt2(
        vocab_size,
        positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
