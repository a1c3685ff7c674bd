"""ZeRO-3 step time and per-rank model-state memory against its peers, side
by side in one run.

GPT-2 (6 layers, hidden 512, 8 heads, vocab 8192, sequence 256, batch 4 per
rank, fp32, AdamW, one thread per rank, 2 ranks), the configuration of the
DDP and ZeRO-1/2 benchmarks. Rows, sampled alternately:

- single process (rank 0 alone; the others wait);
- 2 processes, no communication (what sharing the machine costs);
- pc FullyShardedDataParallel (a unit per GPT2Block) and pc GeminiDDP,
  each also stepping every chunk in backward (``step_in_backward=True``);
- torch FSDP2 (``fully_shard`` per block and on the root, gloo);
- DeepSpeed ZeRO stage 3 (gloo, CPU accelerator), when deepspeed imports
  in this environment (`nox -s bench` installs it).

Memory: model-state bytes per rank after a step (parameters or shards,
gradients, optimizer states), counted from the tensors each one holds.
Every row is also given over FSDP2's, paired round by round.

``--quick`` (``nox -s bench_quick``): only the single process, the floor,
pc FSDP, pc GeminiDDP and FSDP2, and one line per pair (pc over FSDP2,
paired) instead of the tables.

    python benchmarks/bench_zero3.py [--iters 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    alternate,
    deepspeed_gpt2,
    pair_line,
    paired_ratios,
    print_step_table,
    rounds_against,
    step_gpt2,
    step_times,
)
from torch import nn

from pc_comm.testing import spawn
from pc_zero import (
    FullyShardedDataParallel,
    GeminiDDP,
    GeminiOptimizer,
    transformer_auto_wrap_policy,
)

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
Step = Callable[[], None]
FSDP2 = "torch FSDP2 fully_shard (gloo)"
# The acceptance targets (issue 41): pc over FSDP2, paired, at or below.
TARGETS = {"pc FullyShardedDataParallel": 0.88, "pc GeminiDDP": 0.91}
QUICK_ROWS = (*TARGETS, FSDP2)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(seed))


def _loop(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> Step:
    batch = _batch(seed)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()

    return step


def _local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def _block() -> type[nn.Module]:
    import transformers.models.gpt2.modeling_gpt2 as gpt2

    block: type[nn.Module] = gpt2.GPT2Block
    return block


def _ours(kind: str, seed: int) -> tuple[Step, Callable[[], int]]:
    model = step_gpt2()
    wrapped: FullyShardedDataParallel | GeminiDDP
    in_backward = kind.endswith("-step-in-backward")
    if kind.startswith("fsdp"):
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=transformer_auto_wrap_policy({_block()}),
            step_in_backward=in_backward,
        )
    else:
        wrapped = GeminiDDP(
            model,
            min_chunk_size=1 << 20,
            search_range=1 << 21,
            step_in_backward=in_backward,
        )
    opt: torch.optim.Optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if in_backward:
        opt = GeminiOptimizer(opt, wrapped)
    return _loop(wrapped, opt, seed), lambda: wrapped.memory(opt).total


def _fsdp2(seed: int) -> tuple[Step, Callable[[], int]]:
    from torch.distributed.fsdp import fully_shard

    model = step_gpt2()
    for module in model.modules():
        if isinstance(module, _block()):
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def memory() -> int:
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return _local_bytes(params) + _local_bytes(grads) + _local_bytes(_states(opt))

    return _loop(model, opt, seed), memory


def _deepspeed(seed: int) -> tuple[Step, Callable[[], int]] | None:
    found = deepspeed_gpt2({"stage": 3}, _batch(seed))
    if found is None:
        return None
    step, engine, model = found

    def memory() -> int:
        inner = engine.optimizer
        shards = getattr(inner, "fp32_partitioned_groups_flat", [])
        params = [p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor")]
        grads = getattr(inner, "fp32_partitioned_groups_flat_grad", None) or []
        return (
            _local_bytes(params)
            + _local_bytes(list(shards))
            + _local_bytes(list(grads))
            + _local_bytes(_states(inner.optimizer))
        )

    return step, memory


def _steps(iters: int, out: str, quick: bool) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = step_gpt2()
    alone = _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4), rank)
    steps: dict[str, Step] = {
        "single process": alone if rank == 0 else lambda: None,
        "2 processes, no communication": alone,
    }
    memories: dict[str, Callable[[], int]] = {}
    makers: dict[str, Callable[[], tuple[Step, Callable[[], int]] | None]] = {
        "pc FullyShardedDataParallel": lambda: _ours("fsdp", rank),
        "pc FullyShardedDataParallel, step in backward": lambda: _ours(
            "fsdp-step-in-backward", rank
        ),
        "pc GeminiDDP": lambda: _ours("gemini", rank),
        "pc GeminiDDP, step in backward": lambda: _ours("gemini-step-in-backward", rank),
        FSDP2: lambda: _fsdp2(rank),
        "DeepSpeed ZeRO-3 (gloo)": lambda: _deepspeed(rank),
    }
    # Built in this order either way (the quick run's rows are a subset).
    peers = {name: make() for name, make in makers.items() if not quick or name in QUICK_ROWS}
    for name, entry in peers.items():
        if entry is not None:
            steps[name], memories[name] = entry
    for fn in steps.values():
        fn()  # warm-up: optimizer states exist from here on
    samples = alternate(steps, iters, sync=True)
    times, ratios = step_times(samples), paired_ratios(samples)
    vs_fsdp2 = rounds_against(samples, FSDP2)
    sizes = {name: float(fn()) for name, fn in memories.items()}
    if rank == 0:
        result = {"times": times, "ratios": ratios, "vs_fsdp2": vs_fsdp2, "memory": sizes}
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="pc over FSDP2 only, one line each")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("zero3_quick.json" if args.quick else "zero3_step.json")
    spawn(_steps, 2, args=(args.iters, str(out), args.quick), timeout=3000)
    result = json.loads(out.read_text())
    if args.quick:
        floor = result["ratios"]["2 processes, no communication"]
        print(f"ZeRO-3 floor (2 processes, no communication / single process): {floor:.3f} paired")
        for name, target in TARGETS.items():
            print(pair_line(name, FSDP2, result["vs_fsdp2"][name], target))
        return
    title = "ZeRO-3 step, GPT-2 6x512, batch 4x256 per rank, fp32 AdamW, 2 ranks, 1 thread each"
    print_step_table(title, result["times"], result["ratios"], (FSDP2, result["vs_fsdp2"]))
    print("\n| | model states per rank (MB) |\n|---|---:|")
    for name, nbytes in result["memory"].items():
        print(f"| {name} | {nbytes / 2**20:.1f} |")
    print()
    for name, target in TARGETS.items():
        print(pair_line(name, FSDP2, result["vs_fsdp2"][name], target))


if __name__ == "__main__":
    main()
