"""pc-tensor against torch's tensor parallelism (DTensor,
``parallelize_module`` with the Megatron plan and ``loss_parallel``), same
model, same step, side by side in one run.

A ``transformers`` Llama and a Qwen2 (4 layers, hidden 512, 8 heads, MLP
1408, vocabulary 8192; Qwen2 adds biases to query, key and value), batch
4 x 256 tokens, next-token loss from vocabulary-sharded logits, AdamW; 2
ranks with one thread each on gloo, tp 2. Both are sharded by pc from
transformers' own tensor-parallel plan (``config.base_model_tp_plan``),
and torch's side from the same plan, style by style. Rows: the whole model
in one process, pc tensor parallelism with and without sequence
parallelism, and torch's. Also the parameter bytes each rank holds.

    python benchmarks/bench_tensor.py [--iters 8] [--families llama qwen2]
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import alternate, step_times
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate, Shard
from transformers import AutoConfig, AutoModelForCausalLM

from pc_comm.testing import spawn
from pc_tensor import shard_model

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
LAYERS, BATCH, SEQUENCE, VOCAB = 4, 4, 256, 8192


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )
    model: nn.Module = AutoModelForCausalLM.from_config(config)
    return model


def _torch_tp(model: nn.Module) -> nn.Module:
    """torch's tensor parallelism from the family's transformers plan:
    colwise -> ColwiseParallel, rowwise -> RowwiseParallel, the embedding
    split by vocabulary and the LM head's logits left sharded for
    loss_parallel."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    config: Any = model.config
    for key, style in config.base_model_tp_plan.items():
        if style not in styles:
            raise ValueError(f"bench_tensor: torch has no style for {key}: {style}")
        for i in range(LAYERS):
            plan["model." + key.replace("*", str(i))] = styles[style]()
    parallelize_module(model, mesh, plan)
    return model


def _adamw(params: list[nn.Parameter]) -> list[torch.optim.Optimizer]:
    """AdamW with foreach kernels. Under torch's tensor parallelism the
    sharded parameters are DTensors and the rest plain tensors, which one
    foreach call cannot mix: one optimizer for each kind."""
    kinds = [
        [p for p in params if hasattr(p, "to_local")],
        [p for p in params if not hasattr(p, "to_local")],
    ]
    return [torch.optim.AdamW(k, lr=1e-4, foreach=True) for k in kinds if k]


def _bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _run(iters: int, out: str, family: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    base = _model(family)
    models = {
        "single process": base,
        "pc tp": shard_model(copy.deepcopy(base)),
        "pc tp + sp": shard_model(copy.deepcopy(base), sequence_parallel=True),
        "torch tp": _torch_tp(copy.deepcopy(base)),
    }
    optimizers = {name: _adamw(list(m.parameters())) for name, m in models.items()}
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        model, optimizer = models[name], optimizers[name]
        if name == "single process" and rank != 0:
            return
        if name.startswith("torch"):
            logits = model(input_ids=ids).logits
            with loss_parallel():
                loss = nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
                )
                loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        for opt in optimizer:
            opt.step()
            opt.zero_grad()
        losses[name] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    fns: dict[str, Callable[[], None]] = {name: partial(step, name) for name in models}
    for fn in fns.values():  # warm-up
        fn()
    samples = alternate(fns, iters, sync=True)
    times = step_times(samples)
    if rank == 0:
        result = {
            "times": times,
            "bytes": {name: _bytes(m) for name, m in models.items()},
            "losses": losses,
        }
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--families", nargs="+", default=["llama", "qwen2"])
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    everything = {}
    for family in args.families:
        out = RESULTS / f"tensor-{family}.json"
        spawn(_run, 2, args=(args.iters, str(out), family), timeout=1800)
        result = everything[family] = json.loads(out.read_text())
        times, sizes = result["times"], result["bytes"]
        single = times["single process"]
        print(f"\n## Tensor parallelism: {family} 4 layers, hidden 512, tp 2, 2 CPU ranks\n")
        print("| | step (s) | / single process | / torch tp | parameter MiB per rank |")
        print("|---|---:|---:|---:|---:|")
        for name, seconds in times.items():
            print(
                f"| {name} | {seconds:.3f} | {seconds / single:.3f} | "
                f"{seconds / times['torch tp']:.3f} | {sizes[name] / 2**20:.1f} |"
            )
        print(f"\nlosses after the last step (every row ran the same steps): {result['losses']}")
    (RESULTS / "bench_tensor.json").write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
