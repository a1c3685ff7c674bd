"""GPU only: the largest GPT-2-shaped model that trains on one GPU with
Gemini's heterogeneous placement (``GeminiDDP``, placement ``auto`` against
the GPU's free memory, host shards stepped by ``HybridAdam``) against torch
FSDP2 (``fully_shard`` with ``CPUOffloadPolicy``, fused AdamW on the host),
and the tokens/s of each at a size both train. ``gemini-step-in-backward``
is Gemini stepping each chunk inside backward (``step_in_backward=True``:
no gradient shard kept per chunk, so 12 bytes per parameter of model
states instead of 16, on the host and in "auto" placement's plan).

The model: GPT-2's block (pre-LayerNorm, fused qkv, 4x MLP, GELU), hidden
4096, 32 heads, vocab 50257, sequence 1024, untied head; the depth varies.
bf16 compute, fp32 master weights, gradients reduced in fp32, AdamW;
every block is activation-checkpointed (non-reentrant) in both.

Weights are filled with a fixed sawtooth pattern instead of random draws:
drawing ten billion normal values on the host takes minutes (twice under
lazy initialisation, which replays each draw), and the pattern changes
neither the memory nor the step time. Both sides get the same values.

``python benchmarks/gpu_largest_model.py search --framework gemini
gemini-step-in-backward fsdp2 --layers 24 32 40 48 56 64`` runs one
process per trial (a trial that runs out of memory, on the GPU or the host,
cannot spoil the next), going up in
depth until a size fails; ``trial`` runs one. Not part of ``nox -s bench``
(CPU machine); ``nox -s bench_gpu`` runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 50257


def _pattern(shape: torch.Size, scale: float) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    ramp = torch.arange(numel, dtype=torch.int32).remainder_(251).float()
    return ramp.sub_(125.0).mul_(scale / 125.0).view(shape)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # Raw parameters, no default initialisers: see init_weights.
        self.ln1_w, self.ln1_b = nn.Parameter(torch.empty(width)), nn.Parameter(torch.empty(width))
        self.qkv_w = nn.Parameter(torch.empty(3 * width, width))
        self.qkv_b = nn.Parameter(torch.empty(3 * width))
        self.proj_w, self.proj_b = (nn.Parameter(torch.empty(width, width)),
                                    nn.Parameter(torch.empty(width)))  # fmt: skip
        self.ln2_w, self.ln2_b = nn.Parameter(torch.empty(width)), nn.Parameter(torch.empty(width))
        self.fc_w, self.fc_b = (nn.Parameter(torch.empty(4 * width, width)),
                                nn.Parameter(torch.empty(4 * width)))  # fmt: skip
        self.out_w, self.out_b = (nn.Parameter(torch.empty(width, 4 * width)),
                                  nn.Parameter(torch.empty(width)))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = F.layer_norm(x, (h,), self.ln1_w, self.ln1_b)
        qkv = F.linear(y, self.qkv_w, self.qkv_b).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(b, s, h), self.proj_w, self.proj_b)
        y = F.layer_norm(x, (h,), self.ln2_w, self.ln2_b)
        y = F.gelu(F.linear(y, self.fc_w, self.fc_b), approximate="tanh")
        out: torch.Tensor = x + F.linear(y, self.out_w, self.out_b)
        return out


class GPT(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.empty(VOCAB, width))
        self.wpe = nn.Parameter(torch.empty(seq, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.lnf_w, self.lnf_b = nn.Parameter(torch.empty(width)), nn.Parameter(torch.empty(width))
        self.head = nn.Parameter(torch.empty(VOCAB, width))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Matrices: the sawtooth pattern (scale 0.02); LayerNorm weights 1;
        biases 0. On FSDP2's sharded DTensors, each local shard."""
        for name, p in self.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() >= 2:
                local.copy_(_pattern(local.shape, 0.02))
            elif name.split(".")[-1].endswith("_w"):
                local.fill_(1.0)
            else:
                local.zero_()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = F.embedding(ids, self.wte) + self.wpe[:s]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x = F.layer_norm(x, (x.shape[-1],), self.lnf_w, self.lnf_b)
        logits = F.linear(x, self.head)
        loss: torch.Tensor = F.cross_entropy(logits.float().view(-1, VOCAB), labels.reshape(-1))
        return loss


def _params(width: int, layers: int, seq: int) -> int:
    per_block = 12 * width * width + 13 * width
    return 2 * VOCAB * width + seq * width + 2 * width + layers * per_block


def _host_rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """The wrapped model, its optimizer, and a step function's extras."""
    if args.framework.startswith("gemini"):
        from pc_chunk import LazyInitContext
        from pc_offload import HybridAdam
        from pc_zero import GeminiDDP, GeminiOptimizer

        with LazyInitContext():
            model = GPT(args.width, args.layers, args.heads, args.seq)
        if device.type == "cuda":  # the rest of the GPU is left for activations
            budget = int(torch.cuda.mem_get_info()[0] - args.reserve_gib * (1 << 30))
        else:
            budget = args.budget_gib << 30
        wrapped: nn.Module = GeminiDDP(
            model,
            device=device,
            placement_policy="auto",
            device_budget_bytes=budget,
            mixed_precision=torch.bfloat16,
            step_in_backward=args.framework == "gemini-step-in-backward",
        )
        inner = HybridAdam(wrapped.parameters(), lr=1e-4, weight_decay=0.01)
        gemini_opt = GeminiOptimizer(inner, wrapped)  # type: ignore[arg-type]
        return wrapped, gemini_opt, {"offload_param_frac": wrapped.offload_param_frac}
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(args.width, args.layers, args.heads, args.seq)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if device.type == "cuda" else None
    kwargs: dict[str, Any] = {"mp_policy": mp}
    if offload is not None:
        kwargs["offload_policy"] = offload
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu" if offload is not None else device)
    model.init_weights()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=False)
    return model, opt, {}


def trial(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    result: dict[str, Any] = {
        "framework": args.framework,
        "layers": args.layers,
        "params": _params(args.width, args.layers, args.seq),
        "ok": False,
    }
    free_at_start = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 0
    start = time.perf_counter()
    try:
        model, opt, extra = _build(args, device)
        result.update(extra)
        result["build_s"] = round(time.perf_counter() - start, 1)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen).to(device)
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            loss = model(ids[:, :-1], ids[:, 1:])
            if hasattr(opt, "backward"):
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        result.update(
            ok=True,
            step_s=round(step, 3),
            tokens_per_s=round(args.batch * args.seq / step, 1),
            losses=[round(x, 4) for x in losses],
        )
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if device.type == "cuda":
        result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        # What the caching allocator never took: the room a smaller
        # --reserve-gib could give Gemini's chunks.
        unused = free_at_start - torch.cuda.max_memory_reserved()
        result["gpu_never_used_gb"] = round(unused / 1e9, 2)
    result["peak_host_rss_gb"] = round(_host_rss_peak() / 1e9, 2)
    result["total_s"] = round(time.perf_counter() - start, 1)
    return result


def search(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for framework in args.framework:
        for layers in args.layers:
            cmd = [sys.executable, __file__, "trial", "--framework", framework,
                   "--layers", str(layers), "--width", str(args.width), "--heads",
                   str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--reserve-gib", str(args.reserve_gib)]  # fmt: skip
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                row = json.loads(lines[-1][7:]) if lines else {
                    "framework": framework, "layers": layers, "ok": False,
                    "params": _params(args.width, layers, args.seq),
                    "error": f"exit {done.returncode} (killed: host memory?) "
                             + done.stderr.strip().splitlines()[-1][:200]
                    if done.stderr.strip() else f"exit {done.returncode}",
                }  # fmt: skip
            except subprocess.TimeoutExpired:
                row = {"framework": framework, "layers": layers, "ok": False,
                       "params": _params(args.width, layers, args.seq),
                       "error": f"timeout {args.timeout}s"}  # fmt: skip
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            print("ROW", json.dumps(row), flush=True)
            rows.append(row)
            if not row["ok"]:
                break
    print("\n| framework | layers | parameters (B) | trains | step (s) | tokens/s | "
          "peak GPU (GB) | GPU never used (GB) | peak host RSS (GB) | note |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['framework']} | {r['layers']} | {r['params'] / 1e9:.2f} | "
            f"{'yes' if r['ok'] else 'no'} | {r.get('step_s', '')} | {r.get('tokens_per_s', '')} | "
            f"{r.get('peak_gpu_gb', '')} | {r.get('gpu_never_used_gb', '')} | "
            f"{r.get('peak_host_rss_gb', '')} | "
            f"{r.get('error', '')[:120]} {r.get('offload_param_frac', '')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["trial", "search"])
    parser.add_argument(
        "--framework",
        nargs="+",
        default=["gemini", "gemini-step-in-backward", "fsdp2"],
        choices=["gemini", "gemini-step-in-backward", "fsdp2"],
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 32, 40, 48, 56, 64, 72, 80])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reserve-gib", type=float, default=12.0,
                        help="GPU memory Gemini's budget leaves for activations")  # fmt: skip
    parser.add_argument("--budget-gib", type=int, default=1, help="CPU smoke runs only")
    parser.add_argument("--timeout", type=float, default=400.0)
    args = parser.parse_args()
    if args.mode == "search":
        search(args)
        return
    args.framework = args.framework[0]
    args.layers = args.layers[0]
    print("RESULT " + json.dumps(trial(args)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
