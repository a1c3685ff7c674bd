"""What ZeRO-3 holds at the end of forward: pc's GeminiDDP against torch's
FSDP2 (``fully_shard`` per layer, resharding after forward), side by side
in one run, 2 ranks, gloo.

A 16-layer MLP of width 1024 (64 MiB of fp32 parameters), one chunk or
one FSDP unit per layer, a batch of 8. Counted from outside at the end of
forward, before backward: every storage autograd saved for backward
(reachable from the loss's graph), plus Gemini's gathered payloads, in
multiples of the model's parameter bytes. [Note: one payload storage] in
pc_chunk.chunk says why it was 0.95 before (each linear layer's saved
``weight.t()`` kept its released payload alive).

    python benchmarks/gemini_forward_memory.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_comm.testing import saved_storage_bytes, spawn

LAYERS, WIDTH, BATCH, STEPS = 16, 1024, 8, 3


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _gemini() -> tuple[nn.Module, Any]:
    from pc_zero import GeminiDDP

    model = GeminiDDP(_mlp(), chunk_size=WIDTH * WIDTH + 2 * WIDTH)
    return model, model.manager.chunks


def _fsdp2() -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, []


def _run(out: str) -> None:
    rows: dict[str, list[float]] = {}
    params = sum(p.numel() * 4 for p in _mlp().parameters())
    for name, build in (("pc GeminiDDP", _gemini), ("torch FSDP2", _fsdp2)):
        model, chunks = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        rows[name] = []
        for step in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            live = saved_storage_bytes(loss)
            for chunk in chunks:  # what Gemini holds gathered
                if chunk.payload is not None:
                    storage = chunk.payload.untyped_storage()
                    live[storage.data_ptr()] = storage.nbytes()
            rows[name].append(sum(live.values()) / params)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"params_mib": params / 2**20, "rows": rows}))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        spawn(_run, 2, args=(out,), timeout=600)
        result = json.loads(Path(out).read_text())
    print(f"model: {result['params_mib']:.1f} MiB of fp32 parameters, world 2")
    print("live at the end of forward, x the parameter bytes, steps 1..3:")
    for name, values in result["rows"].items():
        print(f"  {name:14s} " + "  ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
