"""Expert parallelism against experts replicated under data parallelism, on
the same Mixtral-shaped model and step, side by side in one run: tokens/s
(paired round by round against the replicated layout), the model states a
rank holds (parameters, gradients, Adam states; of them the experts'), and
the resident memory each layout added on each rank (built, stepped once,
gradients held).

Mixtral layout: hidden 256, 4 layers, 8 experts of ffn 512 (top 2), vocab
2048, sequence 128, batch 4 per rank, fp32 AdamW, ZeRO-1 over the data-
parallel ranks (``HybridParallelPlugin(zero_stage=1, ep_size=...)``), the
router's auxiliary loss on. ``--world 2``: ep 1 and 2; ``--world 4``: ep 1,
2 and 4 (on this 2-core machine 4 ranks share 2 cores: compare rows, not
absolute rates). DeepSpeed-MoE needs its own MoE layer in place of the
model's (``deepspeed.moe.layer.MoE``), not a transformers model, so it is
not a row here.

    python benchmarks/bench_moe.py [--world 2] [--iters 6]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import alternate, rounds_against

from pc_booster import Booster, HybridParallelPlugin
from pc_comm.testing import spawn
from pc_tensor import find_experts
from pc_train.estimate import measured_model_state_bytes

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
HIDDEN, LAYERS, EXPERTS, FFN, VOCAB, SEQ, BATCH = 256, 4, 8, 512, 2048, 128, 4


def _model() -> torch.nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
        max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.MixtralForCausalLM(config)
    return model


def _rss_mib() -> float:
    """This process's resident memory now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _run(iters: int, out: str) -> None:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    layouts = [ep for ep in (1, 2, 4) if ep <= world and world % ep == 0]
    fns: dict[str, Callable[[], None]] = {}
    states: dict[str, list[float]] = {}
    rss: dict[str, float] = {}
    for ep in layouts:
        before = _rss_mib()
        name = f"ep {ep}" if ep > 1 else "ep 1 (experts replicated)"
        booster = Booster(plugin=HybridParallelPlugin(zero_stage=1, ep_size=ep))
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt, *_ = booster.boost(model, opt)
        gen = torch.Generator().manual_seed(dist.get_rank())
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

        def step(model: Any = model, opt: Any = opt, booster: Booster = booster,
                 ids: torch.Tensor = ids) -> None:  # fmt: skip
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()

        step()  # warm-up; the optimizer states exist
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)  # gradients held, as at their peak
        inner = model.module if hasattr(model, "module") else model
        experts = sum(
            p.numel() * p.element_size() for _, m in find_experts(inner) for p in m.parameters()
        )
        held = torch.tensor(
            [float(measured_model_state_bytes(model, opt)), float(experts)], dtype=torch.float64
        )
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        states[name] = held.tolist()
        opt.zero_grad()
        rss[name] = _rss_mib() - before  # what this layout holds, gradients included
        fns[name] = step
    samples = alternate(fns, iters, sync=True)
    peer = next(iter(fns))
    ratios = {n: statistics.median(r) for n, r in rounds_against(samples, peer).items()}
    times = {}
    for name, s in samples.items():
        t = torch.tensor([statistics.median(s)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = float(t)
    growth = [None] * world
    dist.all_gather_object(growth, rss)
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps(
                {"times": times, "ratios": ratios, "states": states, "rss": growth, "world": world}
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"moe-{args.world}.json"
    spawn(_run, args.world, args=(args.iters, str(out)), timeout=3000)
    result = json.loads(out.read_text())
    world = result["world"]
    tokens = BATCH * SEQ * world
    print(
        f"\n## Expert parallelism: Mixtral {LAYERS} x {HIDDEN}, {EXPERTS} experts (top 2), "
        f"{world} CPU ranks, ZeRO-1, fp32 AdamW\n"
    )
    print(
        "| layout | step (s) | tokens/s | step / experts replicated (paired) | model states per "
        "rank (MiB) | of them expert parameters (MiB) | resident memory added per rank (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, seconds in result["times"].items():
        held, experts = result["states"][name]
        growth = ", ".join(f"{r[name]:.0f}" for r in result["rss"])
        print(
            f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {result['ratios'][name]:.3f} | "
            f"{held / 2**20:.1f} | {experts / 2**20:.1f} | {growth} |"
        )


if __name__ == "__main__":
    main()
