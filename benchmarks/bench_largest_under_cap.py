"""The largest Llama a 2-rank job trains under one memory cap the kernel
enforces, by layout and optimizer-state tier [issue 56].

One shape family: hidden 64k, intermediate 172k, k layers, k heads of 64,
vocabulary 8000 (about 49,000 k^3 parameters), fp32, AdamW (lr 1e-4),
``--steps`` steps of 1 x 32 tokens per rank. Both ranks join one cgroup v1
memory group (``--cap-gib`` for the whole job, swap counted) after their
imports and process group, so the cap holds what the model brings: its
build, parameters, gradients, optimizer states, activations, the
communicators' shared memory and the page cache of any scratch file. A size
fits when every rank finishes; it does not when the kernel's OOM killer
stops a rank. For each layout, sizes are tried upward (or downward) from a
start until the boundary, two layers a stride, then one.

Layouts: pc Gemini stepping in backward (everything on the host) with
fp32, bf16 and 8-bit moments and with fp32 moments on the NVMe tier (a
scratch directory under ``--scratch``, /tmp by default), pc ZeRO-2 with CPU
offload, and torch's FSDP2 with CPUOffloadPolicy (built on the meta device,
each rank materialising its shard). On this machine every tier below the
device is host memory, as it would be beside a GPU.

    python benchmarks/bench_largest_under_cap.py --cap-gib 3
    python benchmarks/bench_largest_under_cap.py --layouts gemini,fsdp2-offload --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import tune_host_allocator
from pc_comm.host_allocator import HostAllocatorSettings
from pc_comm.testing import DistributedTestError, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration_tests"))
from memory_cap import ROOT, MemoryCap, unavailable  # type: ignore[import-not-found, unused-ignore]

GIB = 1 << 30
Step = Callable[[torch.Tensor], float]  # one training step on these token ids; its loss


@dataclass(frozen=True)
class Layout:
    """One way to train the model: ``framework`` pc or torch, and pc's
    optimizer options."""

    framework: str
    plugin: str = "gemini"
    state_dtype: str = "fp32"
    nvme_fraction: float = 0.0


LAYOUTS: dict[str, Layout] = {
    "fsdp2-offload": Layout("torch"),
    "zero2-offload": Layout("pc", plugin="zero2-offload"),
    "gemini": Layout("pc"),
    "gemini-bf16": Layout("pc", state_dtype="bf16"),
    "gemini-int8": Layout("pc", state_dtype="int8"),
    "gemini-nvme": Layout("pc", nvme_fraction=1.0),
    # DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU
    # (ZeRO-Offload), and with the optimizer on disk (ZeRO-Infinity, where
    # its async-IO op builds), when deepspeed imports (nox -s bench).
    "deepspeed-offload": Layout("deepspeed"),
    "deepspeed-infinity": Layout("deepspeed", nvme_fraction=1.0),
}


def llama_config(k: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=8000, hidden_size=64 * k, intermediate_size=172 * k, num_hidden_layers=k,
        num_attention_heads=k, num_key_value_heads=k, max_position_embeddings=64,
    )  # fmt: skip


def parameters_of(k: int) -> int:
    """The model's parameter count, by arithmetic (nothing built)."""
    h, i, v = 64 * k, 172 * k, 8000
    return k * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def _pc_model(layout: Layout, k: int, scratch: str) -> tuple[Any, Step]:
    import transformers

    from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin
    from pc_chunk import LazyInitContext
    from pc_offload import HybridAdam

    with LazyInitContext():
        model = transformers.LlamaForCausalLM(llama_config(k))
    optimizer: Any
    if layout.plugin == "gemini":
        optimizer = HybridAdam(
            model.parameters(), lr=1e-4, state_dtype=layout.state_dtype,
            nvme_offload_fraction=layout.nvme_fraction, nvme_offload_dir=scratch,
        )  # fmt: skip
        plugin: Any = GeminiPlugin(step_in_backward=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        plugin = LowLevelZeroPlugin(stage=2, cpu_offload=True)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return model, step


def _fsdp2_model(k: int) -> tuple[Any, Step]:
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(k)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    offload = CPUOffloadPolicy(pin_memory=False)
    for block in model.model.layers:
        fully_shard(block, offload_policy=offload)
    fully_shard(model, offload_policy=offload)
    model.to_empty(device="cpu")  # each rank materialises its shard only
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0, 0.02)
        model.model.rotary_emb.inv_freq.copy_(LlamaRotaryEmbedding(config).inv_freq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return model, step


def _deepspeed_model(layout: Layout, k: int, scratch: str) -> tuple[Any, Step]:
    import deepspeed  # type: ignore[import-not-found, unused-ignore]
    import transformers

    optimizer_place: dict[str, Any] = {"device": "cpu"}
    if layout.nvme_fraction:
        optimizer_place = {"device": "nvme", "nvme_path": scratch}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": optimizer_place,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 10**9,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):  # each rank builds its shard
        model = transformers.LlamaForCausalLM(llama_config(k))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return engine, step


def train(out: str, layout_name: str, k: int, steps: int, scratch: str, group: str) -> None:
    """One rank: join the job's cap, build, train ``steps`` steps; rank 0
    writes the losses and the step times."""
    import transformers

    # Freed blocks go back to the system at once (pc_comm's [Note: host
    # allocator]), in every layout alike.
    tune_host_allocator(HostAllocatorSettings(mmap_threshold=1 << 20))
    transformers.LlamaForCausalLM(llama_config(1))  # imports before the cap
    if LAYOUTS[layout_name].framework == "deepspeed":
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
        import deepspeed  # noqa: F401  # type: ignore[import-not-found, unused-ignore]
    (ROOT / group / "cgroup.procs").write_text(str(os.getpid()))  # the job's one group
    layout = LAYOUTS[layout_name]
    start = time.perf_counter()
    if layout.framework == "torch":
        _, step = _fsdp2_model(k)
    elif layout.framework == "deepspeed":
        _, step = _deepspeed_model(layout, k, scratch)
    else:
        _, step = _pc_model(layout, k, scratch)
    build = time.perf_counter() - start
    losses: list[float] = []
    times: list[float] = []
    for i in range(steps):
        ids = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(i))
        began = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - began)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"losses": losses, "times": times, "build": build}))


@dataclass(frozen=True)
class Probe:
    """One size tried: whether it fitted, and if so its step times (s)."""

    k: int
    fits: bool
    step_s: float = 0.0
    peak_gib: float = 0.0


def probe(layout: str, k: int, cap_gib: float, steps: int, scratch_root: str) -> Probe:
    """Train ``layout`` at size ``k`` under the cap; an OOM kill is 'does
    not fit', any other failure is raised."""
    group = f"pc-bench-cap-{os.getpid()}"
    cap = MemoryCap(group, int(cap_gib * GIB))
    try:
        with tempfile.TemporaryDirectory(dir=scratch_root) as scratch:
            out = str(Path(scratch) / "out.json")
            try:
                spawn(train, 2, args=(out, layout, k, steps, scratch, group), timeout=1800)
            except DistributedTestError:
                if cap.oom_kills() > 0:
                    return Probe(k, False)
                raise
            result = json.loads(Path(out).read_text())
        times = sorted(result["times"][1:] or result["times"])
        return Probe(k, True, times[len(times) // 2], cap.peak() / GIB)
    finally:
        cap.remove()


def largest(layout: str, start: int, cap_gib: float, steps: int, scratch: str) -> list[Probe]:
    """Every size tried, up (or down) from ``start`` by two layers, then
    one, until the boundary between the largest that fits and the next."""
    tried: dict[int, Probe] = {}

    def at(k: int) -> Probe:
        if k not in tried:
            tried[k] = probe(layout, k, cap_gib, steps, scratch)
            p = tried[k]
            state = f"fits, {p.step_s:.2f} s/step, peak {p.peak_gib:.2f} GiB" if p.fits else "OOM"
            print(f"    {layout} k={k} ({parameters_of(k) / 1e6:.0f} M): {state}", flush=True)
        return tried[k]

    k = start
    if at(k).fits:
        while at(k + 2).fits:
            k += 2
        at(k + 1)
    else:
        while k > 2 and not at(k - 2).fits:
            k -= 2
        at(k - 1)
    return sorted(tried.values(), key=lambda p: p.k)


def best(tried: list[Probe]) -> Probe | None:
    fitting = [p for p in tried if p.fits]
    return max(fitting, key=lambda p: p.k) if fitting else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-gib", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--start", type=int, default=12)
    parser.add_argument("--layouts", default=",".join(k for k in LAYOUTS if "deepspeed" not in k))
    parser.add_argument("--scratch", default=tempfile.gettempdir())
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench_largest_under_cap needs memory caps: {why}")
    print(f"Llama hidden 64k, k layers, fp32 + AdamW, 2 ranks, {args.steps} steps, "
          f"{args.cap_gib:g} GiB cap on the whole job", flush=True)  # fmt: skip
    rows: dict[str, Probe | None] = {}
    start = args.start
    for layout in args.layouts.split(","):
        found = best(largest(layout, start, args.cap_gib, args.steps, args.scratch))
        rows[layout] = found
        start = found.k if found is not None else start
    base = rows.get("fsdp2-offload")
    print("| layout | largest k | parameters | x FSDP2 + CPUOffloadPolicy | s / step | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout, found in rows.items():
        if found is None:
            print(f"| {layout} | none fits | | | | |")
            continue
        ratio = parameters_of(found.k) / parameters_of(base.k) if base is not None else float("nan")
        print(f"| {layout} | {found.k} | {parameters_of(found.k) / 1e6:.0f} M | {ratio:.2f}x | "
              f"{found.step_s:.2f} | {found.peak_gib:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
