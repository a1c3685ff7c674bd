"""Per-rank host memory of pc's sharded layouts beside torch's, at several
world sizes, counted from outside the library [issue 56].

A 12 M-parameter Qwen2 (hidden 256, 8 layers, vocab 8192, untied), fp32 +
AdamW, two steps of 2 x 32 tokens per rank, each layout in a fresh gloo
process group. ``pc_comm.testing.host_memory`` counts every live tensor's
storage on a rank plus its share of the node's shared segments
([Note: counting a rank's host memory]), after backward and after the step,
in multiples of the fp32 parameter bytes P; the ZeRO paper's fp32 figure
beside it. ``states`` leaves out the communicator's slots (a fixed
(N + 1) / N x 16 MiB per rank, given in MiB). The largest rank is shown.

    python benchmarks/bench_host_memory.py [--worlds 2,4,8]

``integration_tests/test_host_memory.py`` asserts the pc rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from pc_comm.testing import host_memory, spawn

PC_LAYOUTS = ["zero1", "zero2", "gemini", "pc-fsdp", "torch-fsdp2-plugin"]
PEERS = ["torch-ddp", "torch-ddp+zero-redundancy", "torch-fsdp2"]

# What each row's model states should be by the ZeRO paper, fp32 + Adam,
# in multiples of P (parameters P, gradients P, two moments 2P; each / N
# where the layout shards it).
PAPER: dict[str, Callable[[int], float]] = {
    "torch-ddp": lambda n: 4.0,
    "torch-ddp+zero-redundancy": lambda n: 2 + 2 / n,
    "zero1": lambda n: 2 + 2 / n,
    "zero2": lambda n: 1 + 3 / n,
}


def paper(layout: str, n: int) -> float:
    """The ZeRO paper's per-rank model states for ``layout`` on ``n`` ranks
    (stage 3 for the fully sharded ones), over P."""
    formula = PAPER.get(layout)
    return formula(n) if formula is not None else 4 / n


def qwen2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, use_sliding_window=False,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen2ForCausalLM(config)
    return model


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _plain(model: nn.Module) -> tuple[nn.Module, Any, Callable[[torch.Tensor], None]]:
    return model, _adamw(model.parameters()), lambda loss: loss.backward()


def boost(layout: str, model: nn.Module) -> tuple[nn.Module, Any, Callable[[torch.Tensor], None]]:
    """``layout`` applied to ``model``: the module to call, its optimizer,
    and how to run backward."""
    from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchFSDPPlugin
    from pc_zero import FullyShardedDataParallel, TransformerBlockPolicy

    if layout == "pc-fsdp":
        policy = TransformerBlockPolicy(frozenset({Qwen2DecoderLayer}))
        return _plain(FullyShardedDataParallel(model, auto_wrap_policy=policy))
    if layout == "torch-ddp":
        return _plain(torch.nn.parallel.DistributedDataParallel(model))
    if layout == "torch-ddp+zero-redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
        return wrapped, optimizer, lambda loss: loss.backward()
    if layout == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.modules():
            if isinstance(block, Qwen2DecoderLayer):
                fully_shard(block)
        fully_shard(model)
        return _plain(model)
    plugins: dict[str, Callable[[], Plugin]] = {
        "zero1": lambda: LowLevelZeroPlugin(stage=1),
        "zero2": lambda: LowLevelZeroPlugin(stage=2),
        "gemini": GeminiPlugin,
        "torch-fsdp2-plugin": TorchFSDPPlugin,
    }
    booster = Booster(plugin=plugins[layout]())
    boosted, optimizer, *_ = booster.boost(model, _adamw(model.parameters()))
    return boosted, optimizer, lambda loss: booster.backward(loss, optimizer)


def measure(out: str, layout: str) -> None:
    """One layout in a fresh process group (a second communicator, or a
    previous layout's buffers, would be counted in this one's). Writes, per
    rank, {phase: [states / P, slot bytes, per rank / P]}."""
    n = dist.get_world_size()
    model = qwen2()
    params = sum(p.numel() * 4 for p in model.parameters())
    wrapped, optimizer, backward = boost(layout, model)
    del model
    for step in range(2):
        ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(step))
        loss = wrapped(input_ids=ids, labels=ids).loss
        backward(loss)
        del loss
        after_backward = host_memory(n)
        optimizer.step()
        optimizer.zero_grad()
        after_step = host_memory(n)
    row = {
        phase: [m.states_per_rank / params, m.slots_per_rank, m.per_rank / params]
        for phase, m in (("backward", after_backward), ("step", after_step))
    }
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


Rows = list[dict[str, dict[str, list[float]]]]


def run_world(folder: Path, n: int, layouts: list[str]) -> Rows:
    """Per rank: {layout: {phase: [states / P, slot bytes, per rank / P]}}."""
    rows: Rows = [{} for _ in range(n)]
    for layout in layouts:
        out = folder / f"{layout}-{n}.json"
        spawn(measure, n, args=(str(out), layout), timeout=600)
        for rank, row in enumerate(json.loads(out.read_text())):
            rows[rank][layout] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8")
    args, _ = parser.parse_known_args()  # nox -s bench passes --iters and the like
    worlds = [int(w) for w in args.worlds.split(",")]
    layouts = PEERS + PC_LAYOUTS
    with tempfile.TemporaryDirectory() as folder:
        results = {n: run_world(Path(folder), n, layouts) for n in worlds}
    print(
        "per-rank host memory, x fp32 parameter bytes (largest rank): after backward / after step"
    )
    print(f"{'layout':28s}" + "".join(f"  world {n}: states | total | paper" for n in worlds))
    for layout in layouts:
        line = f"{layout:28s}"
        for n in worlds:
            b, s = (max(r[layout][p][0] for r in results[n]) for p in ("backward", "step"))
            tb, ts = (max(r[layout][p][2] for r in results[n]) for p in ("backward", "step"))
            line += f"  {b:5.2f}/{s:4.2f} | {tb:4.2f}/{ts:4.2f} | {paper(layout, n):4.2f}"
        print(line)
    slots = {n: max(r[lay]["step"][1] for r in results[n] for lay in layouts) for n in worlds}
    print("communicator slots per rank, MiB: " + ", ".join(
        f"world {n} {v / 2**20:.1f}" for n, v in slots.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
