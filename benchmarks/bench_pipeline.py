"""pc-pipeline against torch.distributed.pipelining, same model, same
schedule, side by side in one run.

An MLP of 8 blocks (Linear 1024x1024 + GELU) split into 2 stages (4 for
interleaved, 2 chunks per rank), 2 ranks with one thread each, batch 512 in
8 microbatches, MSE loss, SGD. Rows: GPipe, 1F1B and Interleaved 1F1B from
both libraries, ZB-H1 (ours), and the whole model in one process. Then the
bubble each of our schedules measured (idle share of the ranks' step time,
from the executor's timeline) next to the bubble the simulator predicts
from the same step's measured forward and backward times.

    python benchmarks/bench_pipeline.py [--iters 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import alternate, step_times
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from pc_comm import ShmCommunicator, TorchCommunicator
from pc_comm.testing import spawn
from pc_pipeline import (
    Costs,
    GPipe,
    Interleaved1F1B,
    PipeDream,
    Pipeline,
    Sequential,
    ZeroBubble,
    partition,
    simulate,
)

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
WIDTH, BLOCKS, BATCH, CHUNKS = 1024, 8, 512, 8
KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _model() -> Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return Sequential(*layers)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _ours(kind: str, transport: str) -> tuple[Pipeline, torch.optim.Optimizer]:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = ShmCommunicator() if transport == "shm" else TorchCommunicator()
    if kind == "interleaved":
        parts = partition(_model(), rank, world, num_model_chunks=2)
        assert isinstance(parts, list)
        pipe: Pipeline = Interleaved1F1B(parts, CHUNKS, communicator=comm, scale_grads=True)
    else:
        stage = partition(_model(), rank, world)
        assert isinstance(stage, nn.Module)
        wrapper = {"gpipe": GPipe, "1f1b": PipeDream, "zb-h1": ZeroBubble}[kind]
        pipe = wrapper(stage, CHUNKS, communicator=comm, scale_grads=True)
    return pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3)


def _torch(kind: str) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.optim.Optimizer]:
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = 2 if kind == "interleaved" else 1
    parts = partition(_model(), rank, world, num_model_chunks=chunks)
    modules = parts if isinstance(parts, list) else [parts]
    stages = [
        PipelineStage(m, c * world + rank, world * chunks, torch.device("cpu"))
        for c, m in enumerate(modules)
    ]
    if kind == "interleaved":
        schedule: ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B = ScheduleInterleaved1F1B(
            list[Any](stages), CHUNKS, loss_fn=_loss
        )
    elif kind == "gpipe":
        schedule = ScheduleGPipe(stages[0], CHUNKS, loss_fn=_loss)
    else:
        schedule = Schedule1F1B(stages[0], CHUNKS, loss_fn=_loss)
    first, last = rank == 0, rank == world - 1
    params = [p for m in modules for p in m.parameters()]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if first:
            schedule.step(x, target=y if last else None)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    return step, torch.optim.SGD(params, lr=1e-3)


def _measured_bubble(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The idle share of 5 steps (median), and the simulator's prediction
    from the same steps' mean time of each (stage, kind)."""
    pipe.record_timeline = True
    world = dist.get_world_size()
    bubbles: list[float] = []
    durations: dict[tuple[int, str], list[float]] = {}
    for _ in range(5):
        dist.barrier()
        pipe.forward_backward(x, criterion=_loss, labels=(y,))
        spans = pipe.timeline
        for action, start, end in spans:
            durations.setdefault((action.stage, action.kind.value), []).append(end - start)
        local = torch.tensor(
            [sum(end - start for _, start, end in spans), max(end for _, _, end in spans)],
            dtype=torch.float64,
        )
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        makespan = max(float(t[1]) for t in gathered)
        bubbles.append(1.0 - sum(float(t[0]) for t in gathered) / (world * makespan))
    pipe.record_timeline = False
    means = {key: sum(v) / len(v) for key, v in durations.items()}
    everyone: list[dict[tuple[int, str], float]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, means)
    table = {key: value for part in everyone for key, value in part.items()}
    latency = _transfer_time(pipe, x.shape[0] // CHUNKS)
    costs = Costs(per_action=lambda a: table[(a.stage, a.kind.value)])
    with_latency = Costs(per_action=costs.per_action, latency=latency)
    return {
        "measured": statistics.median(bubbles),
        "simulated": simulate(pipe.schedule, costs).bubble_fraction,
        "simulated_latency": simulate(pipe.schedule, with_latency).bubble_fraction,
        "latency_ms": latency * 1000,
    }


def _transfer_time(pipe: Pipeline, rows: int) -> float:
    """Half the median round trip of one activation (``rows`` x WIDTH fp32)
    between ranks 0 and 1 over the pipeline's own communicator."""
    comm, rank = pipe.comm, dist.get_rank()
    buf = torch.randn(rows, WIDTH)
    trips = []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
        trips.append(time.perf_counter() - start)
    half = torch.tensor([statistics.median(trips) / 2], dtype=torch.float64)
    dist.broadcast(half, 0)
    return float(half)


def _run(iters: int, kinds: list[str], out: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    single = _model()
    single_opt = torch.optim.SGD(single.parameters(), lr=1e-3)

    def single_step() -> None:
        if rank == 0:
            _loss(single(x), y).backward()  # type: ignore[no-untyped-call]
            single_opt.step()
            single_opt.zero_grad()

    fns: dict[str, Callable[[], None]] = {"single process": single_step}
    pipes: dict[str, Pipeline] = {}
    for kind in kinds:
        for transport in ("shm", "gloo"):
            pipe, opt = _ours(kind, transport)
            pipes[f"{kind} ({transport})"] = pipe

            def ours(pipe: Pipeline = pipe, opt: torch.optim.Optimizer = opt) -> None:
                pipe.forward_backward(x, criterion=_loss, labels=(y,))
                opt.step()
                opt.zero_grad()

            fns[f"pc {kind} ({transport})"] = ours
        if kind == "zb-h1":
            continue
        step, topt = _torch(kind)

        def theirs(
            step: Callable[[torch.Tensor, torch.Tensor], None] = step,
            topt: torch.optim.Optimizer = topt,
        ) -> None:
            step(x, y)
            topt.step()
            topt.zero_grad()

        fns[f"torch {kind}"] = theirs
    for fn in fns.values():  # warm-up: shapes, allocator
        dist.barrier()
        fn()
    times = step_times(alternate(fns, iters, sync=True))
    bubbles = {kind: _measured_bubble(pipe, x, y) for kind, pipe in pipes.items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "bubbles": bubbles}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=list(KINDS), choices=KINDS)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "pipeline.json"
    spawn(_run, 2, args=(args.iters, args.schedules, str(out)), timeout=1800)
    result = json.loads(out.read_text())
    times, bubbles = result["times"], result["bubbles"]
    single = times["single process"]
    title = f"MLP {BLOCKS}x{WIDTH}, batch {BATCH} in {CHUNKS} microbatches, 2 ranks"
    print(f"\n## Pipeline step, {title}\n")
    print(
        "| schedule | pc, shm (s) | pc, gloo (s) | torch, gloo (s) | torch / pc shm "
        "| torch / pc gloo | pc shm / single process |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.schedules:
        shm, gloo = times[f"pc {kind} (shm)"], times[f"pc {kind} (gloo)"]
        theirs = times.get(f"torch {kind}")
        shown = f"{theirs:.4f}" if theirs else "n/a"
        r_shm = f"{theirs / shm:.3f}" if theirs else "n/a"
        r_gloo = f"{theirs / gloo:.3f}" if theirs else "n/a"
        print(
            f"| {kind} | {shm:.4f} | {gloo:.4f} | {shown} | {r_shm} | {r_gloo} "
            f"| {shm / single:.3f} |"
        )
    print(f"| single process | {single:.4f} | | | | | 1.000 |")
    print("\n## Bubble: measured vs simulated from measured action times\n")
    print("| schedule | measured | simulated | simulated with latency | latency (ms) |")
    print("|---|---:|---:|---:|---:|")
    for kind, b in bubbles.items():
        print(
            f"| {kind} | {b['measured']:.1%} | {b['simulated']:.1%} "
            f"| {b['simulated_latency']:.1%} | {b['latency_ms']:.2f} |"
        )
    (RESULTS / "bench_pipeline.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
