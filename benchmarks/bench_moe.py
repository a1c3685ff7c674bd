"""Expert parallelism against experts replicated under data parallelism, and
against DeepSpeed-MoE, on the same Mixtral-shaped model and step, side by
side in one run: tokens/s (paired round by round against the replicated
layout), the model states a rank holds (parameters, gradients, Adam states;
of them the experts'), and the resident memory each layout added on each
rank (built, stepped once, gradients held).

Mixtral layout: hidden 256, 4 layers, 8 experts of ffn 512 (top 2), vocab
2048, sequence 128, batch 4 per rank, fp32 AdamW, ZeRO-1 over the data-
parallel ranks (``HybridParallelPlugin(zero_stage=1, ep_size=...)``), the
router's auxiliary loss on. ``--world 2``: ep 1 and 2; ``--world 4``: ep 1,
2 and 4 (on this 2-core machine 4 ranks share 2 cores: compare rows, not
absolute rates).

DeepSpeed-MoE rows (when deepspeed imports and starts here; ``nox -s
bench`` installs it and sets ``DS_ACCELERATOR=cpu``), one per ep, paired
against the same replicated pc layout: the same model (same config, seed
and initial weights), each decoder layer's sparse MoE block replaced by
``deepspeed.moe.layer.MoE`` (8 experts shaped as Mixtral's: gated SiLU,
w1/w3 256 -> 512, w2 512 -> 256, no bias; the experts' and the router's
weights copied from Mixtral's, so the first forward's loss is Mixtral's),
trained by ``deepspeed.initialize`` with ZeRO stage 1 (fp32, AdamW lr 1e-4
over ``split_params_into_different_moe_groups_for_optimizer``'s groups,
gloo, CPU accelerator). What differs from pc's rows: the gate is
DeepSpeed's top-2 gate (softmax, top 2 without second-expert sampling, the
two weights renormalised, as Mixtral's router computes them), with
DeepSpeed's auxiliary loss (``0.01 * sum`` over layers of ``l_aux``) in
place of Mixtral's load-balancing loss; dropless (``drop_tokens=False``),
it pads every expert to the most loaded expert's token count (its
capacity), dispatches with dense one-hot einsums and exchanges the padded
buffers, where pc sends each (token, expert) row once. Its model states
count each storage once, whole: the parameters (views of DeepSpeed's flat
buffers), their gradients, its fp32 partitions (a copy even in fp32) and
their gradients, its reduced gradient partitions and AdamW's states, after
backward, before the step (by then DeepSpeed's ZeRO-1 has reduced the full
gradients into its partitions and freed them).

    python benchmarks/bench_moe.py [--world 2] [--iters 6]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import alternate, rounds_against
from torch import nn

from pc_booster import Booster, HybridParallelPlugin
from pc_comm.testing import spawn
from pc_tensor import find_experts
from pc_train.estimate import measured_model_state_bytes

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
HIDDEN, LAYERS, EXPERTS, FFN, VOCAB, SEQ, BATCH = 256, 4, 8, 512, 2048, 128, 4
AUX_COEF = 0.01
DS_ZERO_STAGE = 1


def _model(output_router_logits: bool = True) -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS,
        num_experts_per_tok=2, output_router_logits=output_router_logits,
        router_aux_loss_coef=AUX_COEF, max_position_embeddings=SEQ, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def _rss_mib() -> float:
    """This process's resident memory now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


class _GatedExpert(nn.Module):
    """One Mixtral expert as a module, for DeepSpeed's ``Experts`` to copy."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)  # gate
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)  # up
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        return out


class _DeepSpeedMoeBlock(nn.Module):
    """In a decoder layer's ``mlp`` slot: DeepSpeed's MoE layer, returning
    the hidden states as Mixtral's block does; its auxiliary loss is kept
    for the step to add."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe: Any = moe  # deepspeed.moe.layer.MoE: untyped
        # The last forward's l_aux: the decoder layer passes on the hidden
        # states alone, so the step reads the term from here.
        self.l_aux: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        out, self.l_aux, _ = self.moe(hidden_states.reshape(batch * seq, hidden))
        result: torch.Tensor = out.reshape(batch, seq, hidden)
        return result


def _import_deepspeed() -> Any:
    """deepspeed, its communication started on the existing group, or the
    reason it is not here (a str). Before any layout is built, so that its
    import is not counted in a row's resident memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import deepspeed  # type: ignore[import-not-found, unused-ignore]
        import deepspeed.moe.layer  # type: ignore[import-not-found, unused-ignore]
        import deepspeed.moe.utils  # type: ignore[import-not-found, unused-ignore]
    except Exception as error:  # not installed, or its accelerator fails to load
        return f"deepspeed does not import here ({type(error).__name__}: {error})"
    try:
        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
    except Exception as error:  # its failure drops DeepSpeed's rows, not pc's
        return f"deepspeed.init_distributed failed: {type(error).__name__}: {error}"
    return deepspeed


def _deepspeed_moe_model(ds: Any, ep: int) -> tuple[nn.Module, list[_DeepSpeedMoeBlock]]:
    """The Mixtral model with DeepSpeed's MoE layer in every decoder layer,
    the experts this rank holds and the router copied from Mixtral's."""
    model = _model(output_router_logits=False)  # DeepSpeed's gate replaces the router
    blocks = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        # Dropless: capacity is the most loaded expert's count, so
        # capacity_factor and min_capacity do not apply.
        moe = ds.moe.layer.MoE(
            hidden_size=HIDDEN, expert=_GatedExpert(), num_experts=EXPERTS, ep_size=ep, k=2,
            use_residual=False, min_capacity=0, capacity_factor=1.0, drop_tokens=False,
            top2_2nd_expert_sampling=False,
        )  # fmt: skip
        # DeepSpeed's expert-parallel groups (expert before data parallelism,
        # its default) are runs of ep consecutive ranks, each holding
        # EXPERTS // ep experts in order; checked after deepspeed.initialize.
        first = dist.get_rank() % ep * (EXPERTS // ep)
        mixtral = layer.mlp
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(mixtral.gate.weight)
            local = moe.deepspeed_moe.experts.deepspeed_experts
            for i, expert in enumerate(local):
                gate_up = mixtral.experts.gate_up_proj[first + i]
                expert.w1.weight.copy_(gate_up[:FFN])
                expert.w3.weight.copy_(gate_up[FFN:])
                expert.w2.weight.copy_(mixtral.experts.down_proj[first + i])
        layer.mlp = _DeepSpeedMoeBlock(moe)
        blocks.append(layer.mlp)
    return model, blocks


def _deepspeed_state_bytes(engine: Any) -> int:
    """Model states a DeepSpeed engine holds on this rank now: each storage
    once, whole (parameters are views of DeepSpeed's flat buffers)."""
    tensors: list[torch.Tensor] = []
    params = list(engine.module.parameters())
    tensors += params + [p.grad for p in params if p.grad is not None]
    zero = engine.optimizer
    for fp32 in getattr(zero, "single_partition_of_fp32_groups", []):
        tensors += [fp32] + ([fp32.grad] if fp32.grad is not None else [])
    for grads in getattr(zero, "averaged_gradients", {}).values():
        if grads is not None:
            tensors += grads if isinstance(grads, list) else [grads]
    inner = getattr(zero, "optimizer", zero)  # ZeRO wraps the client optimizer; stage 0 not
    tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _deepspeed_row(ds: Any, ep: int, ids: torch.Tensor) -> tuple[Callable[[], None], list[float]]:
    """DeepSpeed-MoE at ``ep``: its training step, stepped once, and
    [model-state bytes, expert-parameter bytes] on this rank, with
    gradients held."""
    model, blocks = _deepspeed_moe_model(ds, ep)
    groups = ds.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": DS_ZERO_STAGE},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=config)
    for block in blocks:
        if dist.get_rank(group=block.moe.deepspeed_moe.ep_group) != dist.get_rank() % ep:
            raise AssertionError(
                f"DeepSpeed's expert-parallel groups at ep {ep} are not runs of ep ranks"
            )

    def backward() -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        aux: Iterable[torch.Tensor] = (b.l_aux for b in blocks if b.l_aux is not None)
        engine.backward(loss + AUX_COEF * sum(aux))

    def step() -> None:
        backward()
        engine.step()  # zeroes the gradients too

    step()  # warm-up; the optimizer states exist
    backward()  # gradients reduced into DeepSpeed's partitions, as before its step
    experts = sum(
        p.numel() * p.element_size() for p in model.parameters() if ds.moe.utils.is_moe_param(p)
    )
    held = [float(_deepspeed_state_bytes(engine)), float(experts)]
    engine.step()
    return step, held


def _pc_row(ep: int, ids: torch.Tensor) -> tuple[Callable[[], None], list[float]]:
    """pc at ``ep``: its training step, stepped once, and [model-state
    bytes, expert-parameter bytes] on this rank, with gradients held."""
    booster = Booster(plugin=HybridParallelPlugin(zero_stage=1, ep_size=ep))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, *_ = booster.boost(model, opt)

    def step(model: Any = model, opt: Any = opt, booster: Booster = booster) -> None:
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
    held = [float(measured_model_state_bytes(model, opt)), float(experts)]
    opt.zero_grad()
    return step, held


def _agreed(failure: str | None) -> str | None:
    """A failure any rank met, on every rank, so all drop the row alike."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, failure)
    return next((r for r in reasons if r is not None), None)


def _run(iters: int, out: str) -> None:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    layouts = [ep for ep in (1, 2, 4) if ep <= world and world % ep == 0]
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    ds = _import_deepspeed()
    absent = _agreed(ds if isinstance(ds, str) else None)
    rows: list[tuple[str, Callable[[], tuple[Callable[[], None], list[float]]]]] = [
        (f"ep {ep}" if ep > 1 else "ep 1 (experts replicated)", partial(_pc_row, ep, ids))
        for ep in layouts
    ]
    rows += [
        (f"DeepSpeed-MoE ep {ep} (ZeRO-{DS_ZERO_STAGE})", partial(_deepspeed_row, ds, ep, ids))
        for ep in ([] if absent else layouts)
    ]
    fns: dict[str, Callable[[], None]] = {}
    states: dict[str, list[float]] = {}
    rss: dict[str, float] = {}
    for name, build in rows:
        deepspeed = name.startswith("DeepSpeed")
        if deepspeed and absent:
            continue
        before = _rss_mib()
        try:
            step, held = build()
            failure = None
        except Exception as error:  # DeepSpeed's failure drops its rows, not pc's
            if not deepspeed:
                raise
            failure = f"{name} failed to start: {type(error).__name__}: {error}"
        if deepspeed and (absent := _agreed(failure)):
            continue
        total = torch.tensor(held, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        states[name] = total.tolist()
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
        result = {"times": times, "ratios": ratios, "states": states, "rss": growth}
        Path(out).write_text(json.dumps({**result, "world": world, "deepspeed_absent": absent}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
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
    if result["deepspeed_absent"]:
        print(f"\nDeepSpeed-MoE rows missing: {result['deepspeed_absent']}.")


if __name__ == "__main__":
    main()
