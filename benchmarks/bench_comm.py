"""pc-comm against its real peers, side by side in one run.

1. Collective overhead: ``TorchCommunicator`` against the raw
   ``torch.distributed`` call it wraps (all-reduce, all-gather,
   reduce-scatter) at several sizes.
2. A data-parallel training step of a small GPT-2: gradients averaged by
   pc-comm's ``all_reduce_coalesced`` after backward, against
   ``torch.nn.parallel.DistributedDataParallel``.

Ratios are pc time / peer time (below 1.0: pc is faster). Results go to
stdout as a Markdown table and to bench-results/bench_comm.json.

    python benchmarks/bench_comm.py [--world-size 2] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import alternate, gpt2

from pc_comm import ReduceOp, TorchCommunicator, all_reduce_coalesced
from pc_comm.testing import spawn

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
# torch before 2.13 names the flat collectives *_into_tensor / *_tensor.
_ALL_GATHER: Callable[..., object] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_REDUCE_SCATTER: Callable[..., object] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def _time_pair(
    ours: Callable[[], None], peer: Callable[[], None], iters: int, warmup: int = 3
) -> tuple[float, float]:
    """Median seconds per call of each side.

    Each sample times enough back-to-back calls to last about 20 ms, so
    loopback jitter on sub-millisecond calls averages out; the two sides
    alternate sample by sample, so drift on a shared machine hits both alike;
    every rank starts each sample together and the slowest rank counts.
    """
    for _ in range(warmup):
        ours()
        peer()
    dist.barrier()
    start = time.perf_counter()
    peer()
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    reps = max(1, int(0.02 / max(float(probe), 1e-6)))
    samples = alternate({"ours": ours, "peer": peer}, iters, reps=reps, sync=True)
    medians = torch.tensor(
        [statistics.median(samples["ours"]), statistics.median(samples["peer"])],
        dtype=torch.float64,
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return float(medians[0]), float(medians[1])


Pair = tuple[Callable[[], None], Callable[[], None]]


def _cases(comm: TorchCommunicator, numel: int) -> dict[str, Pair]:
    """(pc, torch.distributed) calls of each collective on ``numel`` floats."""
    buf = torch.randn(numel)
    shard = torch.empty(numel // comm.world_size)
    full = torch.empty(numel)
    return {
        "all_reduce": (
            lambda: comm.all_reduce(buf).wait(),
            lambda: dist.all_reduce(buf),
        ),
        "all_gather": (
            lambda: comm.all_gather(full, shard).wait(),
            lambda: _ALL_GATHER(full, shard),
        ),
        "reduce_scatter": (
            lambda: comm.reduce_scatter(shard, buf).wait(),
            lambda: _REDUCE_SCATTER(shard, buf),
        ),
    }


def _collectives(iters: int) -> list[dict[str, object]]:
    comm = TorchCommunicator()
    rows: list[dict[str, object]] = []
    for numel in (1_024, 65_536, 1_048_576):
        for name, (ours, peer) in _cases(comm, numel).items():
            t_ours, t_peer = _time_pair(ours, peer, iters)
            rows.append(
                {
                    "benchmark": f"{name} {numel * 4 // 1024} KiB fp32",
                    "pc_ms": t_ours * 1e3,
                    "peer": "torch.distributed",
                    "peer_ms": t_peer * 1e3,
                    "ratio": t_ours / t_peer,
                }
            )
    return rows


def _gpt2() -> torch.nn.Module:
    return gpt2(vocab_size=256, positions=64, width=128, layers=4, heads=4)


def _training_step(iters: int) -> list[dict[str, object]]:
    comm = TorchCommunicator()
    batch = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(comm.rank))

    ours = _gpt2()
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)

    def pc_step() -> None:
        ours_opt.zero_grad(set_to_none=True)
        ours(input_ids=batch, labels=batch).loss.backward()
        grads = [p.grad for p in ours.parameters() if p.grad is not None]
        all_reduce_coalesced(comm, grads, ReduceOp.AVG)
        ours_opt.step()

    peer = torch.nn.parallel.DistributedDataParallel(_gpt2())
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-3)

    def ddp_step() -> None:
        peer_opt.zero_grad(set_to_none=True)
        peer(input_ids=batch, labels=batch).loss.backward()
        peer_opt.step()

    t_ours, t_peer = _time_pair(pc_step, ddp_step, iters)
    params = sum(p.numel() for p in ours.parameters())
    return [
        {
            "benchmark": f"GPT-2 {params / 1e6:.2f} M train step, batch 8x64 per rank",
            "pc_ms": t_ours * 1e3,
            "peer": "torch DDP",
            "peer_ms": t_peer * 1e3,
            "ratio": t_ours / t_peer,
        }
    ]


def _run(iters: int, out: str) -> None:
    torch.set_num_threads(1)
    rows = _collectives(iters) + _training_step(iters)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_comm.json"
    spawn(_run, args.world_size, args=(args.iters, str(out)), timeout=900)
    rows = json.loads(out.read_text())
    print(f"\n## pc-comm vs peers ({args.world_size} gloo ranks, CPU, 1 thread per rank)\n")
    print("| benchmark | pc (ms) | peer | peer (ms) | pc / peer |")
    print("|---|---:|---|---:|---:|")
    for row in rows:
        print(
            f"| {row['benchmark']} | {row['pc_ms']:.3f} | {row['peer']} | "
            f"{row['peer_ms']:.3f} | {row['ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
