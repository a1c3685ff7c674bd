"""What every benchmark shares: alternating timing and the GPT-2 models."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_comm import tune_host_allocator
from pc_comm.testing import tiny_gpt2

# Every benchmark process, the single-process rows' included, keeps freed
# host memory mapped, as pc-train's ranks do ([Note: host allocator]).
tune_host_allocator()


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


def _reps(fns: Mapping[str, Callable[[], object]]) -> int:
    """Back-to-back calls per sample so that the fastest side's sample lasts
    about 20 ms: a single call after a barrier would time the ranks'
    skew leaving the barrier as much as the collective. Agreed by every rank."""
    fastest = float("inf")
    for fn in fns.values():
        fn()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - start)
    slowest_rank = torch.tensor([fastest], dtype=torch.float64)
    dist.all_reduce(slowest_rank, op=dist.ReduceOp.MAX)
    return max(1, math.ceil(0.02 / float(slowest_rank)))


def bus_bandwidth(
    fns: Mapping[str, Callable[[], object]], iters: int, size_mb: int
) -> dict[str, float]:
    """All-reduce bus bandwidth in GB/s of each function (one all-reduce of
    ``size_mb`` MB per call): 2 (n-1)/n * bytes over the slowest rank's
    median time, the functions sampled alternately, each sample long enough
    that the ranks' skew does not count."""
    world = dist.get_world_size()
    samples = alternate(fns, iters, reps=_reps(fns), sync=True)
    factor = 2 * (world - 1) / world * size_mb * 1024 * 1024 / 1e9
    return {name: factor / median_max(s) for name, s in samples.items()}


def step_times(samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Seconds per step for each row of a step benchmark: "single process"
    is rank 0's median (it ran alone), every other row the slowest rank's."""
    return {
        name: statistics.median(s) if name == "single process" else median_max(s)
        for name, s in samples.items()
    }


def paired_ratios(samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Each row over the single process, round by round: the median over
    rounds of (the slowest rank's sample of the row) / (rank 0's
    single-process sample of the same round). The samples of one round are
    seconds apart, so drift over minutes (on this machine a step's time
    wandered from 3.2 to 2.2 s in one run) cancels in the ratio where it
    does not in a ratio of medians."""
    names = list(samples)
    rows = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    slowest = rows.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    single = rows[names.index("single process")].clone()
    dist.broadcast(single, src=0)  # rank 0 ran it; the others' samples are empty calls
    return {
        name: 1.0 if name == "single process" else statistics.median((slowest[i] / single).tolist())
        for i, name in enumerate(names)
    }


def rounds_against(samples: Mapping[str, list[float]], peer: str) -> dict[str, list[float]]:
    """Each row's ratio to the ``peer`` row, round by round: the slowest
    rank's sample of the row over the slowest rank's sample of the peer in
    the same round (seconds apart, so drift cancels as in
    :func:`paired_ratios`). The single process is left out: it is not a
    peer of a distributed row. Every rank must call it."""
    names = [name for name in samples if name != "single process"]
    rows = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    reference = rows[names.index(peer)]
    return {name: (rows[i] / reference).tolist() for i, name in enumerate(names)}


def pair_line(name: str, peer: str, rounds: list[float], target: float | None = None) -> str:
    """One line for ``bench_quick``: a row over its peer, paired (the
    median over rounds), with the rounds' range and the target it is held
    to (at or below)."""
    median = statistics.median(rounds)
    line = (
        f"{name} / {peer}: {median:.3f} paired "
        f"({len(rounds)} rounds, {min(rounds):.3f}-{max(rounds):.3f})"
    )
    if target is not None:  # judged as printed
        line += f", target <= {target:.2f}: {'met' if round(median, 3) <= target else 'NOT met'}"
    return line


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


def step_gpt2() -> nn.Module:
    """The step benchmarks' model: 6 layers, hidden 512, 8 heads, vocab 8192,
    sequence 256 (the hfreduce issue's configuration)."""
    return gpt2(vocab_size=8192, positions=256, width=512, layers=6, heads=8)


def print_step_table(
    title: str,
    times: Mapping[str, float],
    ratios: Mapping[str, float],
    peer: tuple[str, Mapping[str, list[float]]] | None = None,
) -> None:
    """Step times (medians) as a markdown table, over the single process's
    median and round by round (:func:`paired_ratios`); with ``peer`` (its
    row's name and :func:`rounds_against` it), each row over that peer,
    paired, too."""
    single = times["single process"]
    print(f"\n## {title}\n")
    head = "| | step (s) | / single process (medians) | / single process (paired) |"
    rule = "|---|---:|---:|---:|"
    if peer is not None:
        head += f" / {peer[0]} (paired) |"
        rule += "---:|"
    print(head)
    print(rule)
    for name, seconds in times.items():
        line = f"| {name} | {seconds:.3f} | {seconds / single:.3f} | {ratios[name]:.3f} |"
        if peer is not None:
            rounds = peer[1].get(name)
            line += f" {statistics.median(rounds):.3f} |" if rounds else " |"
        print(line)


def deepspeed_gpt2(
    zero_config: dict[str, Any], batch: torch.Tensor
) -> tuple[Callable[[], None], Any, nn.Module] | None:
    """A DeepSpeed engine (CPU accelerator, gloo) over ``step_gpt2()`` with
    AdamW and the given ``zero_optimization`` settings: its training step,
    the engine and the model; None when deepspeed does not import here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import deepspeed  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    model = step_gpt2()
    config = {
        "train_micro_batch_size_per_gpu": batch.shape[0],
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero_config,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step() -> None:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    return step, engine, model
