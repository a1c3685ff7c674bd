"""Ulysses sequence parallelism and ring attention: activation memory per
rank at sp 1, 2 and 4, and the step time, on a ``transformers`` Llama (2 layers, hidden 256, 8
heads over 4 key/value heads, vocabulary 4096) at sequence lengths up to
8192 tokens, batch 1; and whether torch's ``context_parallel`` runs here
(on this CPU machine it does not: DTensor has no sharding strategy for the
CPU flash-attention op SDPA dispatches to).

Activation memory is what the forward saves for backward, counted by
``torch.autograd.graph.saved_tensors_hooks`` (each storage once), per rank:
exact and deterministic, unlike a process's resident size on a machine
whose allocator keeps freed pages. Step time: forward and backward, median
of a few.

    python benchmarks/bench_sequence.py [--seqs 2048 4096 8192] [--iters 3]
    python benchmarks/bench_sequence.py --cap-mib 128 [--modes ulysses ring]

The second form finds the longest sequence (doubling) whose step fits a
per-rank memory cap the kernel enforces (a cgroup per rank, joined after
the model is built), at sp 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pc_comm.testing import spawn
from pc_tensor import ring_model, sync_sequence_grads, ulysses_model

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
VOCAB = 4096


def _model(seq: int) -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
        tie_word_embeddings=False,
    )  # fmt: skip
    model: nn.Module = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model


def _saved_bytes(run: Any, model: nn.Module) -> int:
    """Bytes of the tensors ``run()``'s forward saves for backward, each
    storage counted once, the model's own weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


def _run(seqs: list[int], iters: int, out: str) -> None:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for seq in seqs:
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
        for sp, mode in ((1, "-"), (2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring")):
            if sp > world:
                continue
            group = dist.new_group(list(range(sp)))  # every rank makes it
            if dist.get_rank() >= sp:
                continue
            model = _model(seq)
            if sp > 1:
                (ulysses_model if mode == "ulysses" else ring_model)(model, group)

            def step(model: nn.Module = model, ids: torch.Tensor = ids) -> torch.Tensor:
                loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
                return loss

            saved = _saved_bytes(step, model)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                step().backward()  # type: ignore[no-untyped-call, unused-ignore]
                if sp > 1:
                    sync_sequence_grads(model, group)
                times.append(time.perf_counter() - start)
            mine = torch.tensor([saved, statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            if dist.get_rank() == 0:
                rows.append({"seq": seq, "sp": sp, "mode": mode, "saved_bytes": int(mine[0]),
                             "step_s": float(mine[1])})  # fmt: skip
        dist.barrier()
    note = _try_context_parallel()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"rows": rows, "context_parallel": note}))


def _capped_step(seq: int, mode: str, cap: int, tag: str) -> None:
    """One forward and backward at ``seq`` tokens with each rank's memory
    from then on capped at ``cap`` bytes (its own cgroup; the kernel kills
    a rank that goes over)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration_tests"))
    from memory_cap import MemoryCap  # type: ignore[import-not-found, unused-ignore]

    torch.set_num_threads(1)
    group = dist.group.WORLD
    model = _model(seq)
    if dist.get_world_size() > 1:
        (ulysses_model if mode == "ulysses" else ring_model)(model, group)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    MemoryCap(f"pc-bench-seq-{tag}-{dist.get_rank()}", cap).join()
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
    dist.barrier()


def search(cap_mib: int, start: int, modes: list[str]) -> None:
    """The longest sequence (doubling from ``start``) whose step fits under
    a per-rank cap of ``cap_mib`` MiB (what a rank allocates after its
    model is built: activations and gradients), at sp 1, 2 and 4."""
    from pc_comm.testing import DistributedTestError

    print(f"\n## Longest sequence under a per-rank cap of {cap_mib} MiB\n")
    print("| sp | mode | longest sequence that trains | next (killed) |")
    print("|---:|---|---:|---:|")
    for sp, mode in [(1, "-"), *((n, m) for n in (2, 4) for m in modes)]:
        seq, best = start, 0
        while True:
            tag = f"{sp}-{mode}-{seq}"
            try:
                spawn(_capped_step, sp, args=(seq, mode, cap_mib << 20, tag), timeout=900)
            except DistributedTestError:
                break
            best, seq = seq, seq * 2
        print(f"| {sp} | {mode} | {best} | {seq} |", flush=True)


def _try_context_parallel() -> str:
    """torch's context_parallel on this machine's SDPA, or why it does not
    run here."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as error:
        return f"torch's context_parallel is not in this torch ({error})."
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 8, 64 * dist.get_world_size(), 32) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as error:
        text = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        return f"torch's context_parallel does not run on this CPU machine: {text}"
    return "torch's context_parallel ran on this machine's SDPA (no timed row yet)."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--cap-mib", type=int, default=0,
        help="instead: the longest sequence whose step fits this per-rank cap (cgroup v1, root)",
    )  # fmt: skip
    parser.add_argument("--start", type=int, default=512, help="the search's first length")
    parser.add_argument("--modes", nargs="+", default=["ulysses", "ring"])
    args = parser.parse_args()
    if args.cap_mib:
        search(args.cap_mib, args.start, args.modes)
        return
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "sequence.json"
    spawn(_run, 4, args=(args.seqs, args.iters, str(out)), timeout=3000)
    result = json.loads(out.read_text())
    rows = result["rows"]
    print("\n## Ulysses: activation memory per rank (saved for backward) and step time\n")
    print("| sequence | sp | mode | activations per rank (MiB) | / sp 1 | x sp | step (s) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    base = {r["seq"]: r["saved_bytes"] for r in rows if r["sp"] == 1}
    for r in rows:
        ratio = r["saved_bytes"] / base[r["seq"]]
        mib = r["saved_bytes"] / 2**20
        print(
            f"| {r['seq']} | {r['sp']} | {r['mode']} | {mib:.1f} | {ratio:.3f} | "
            f"{ratio * r['sp']:.3f} | {r['step_s']:.3f} |"
        )
    print(f"\n{result['context_parallel']}")


if __name__ == "__main__":
    main()
