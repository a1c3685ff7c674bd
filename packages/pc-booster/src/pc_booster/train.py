"""``pc-train``: train a small causal language model data-parallel.

Run it plainly and it starts ``--nproc`` local processes itself through
torch's elastic launcher; run it under ``torchrun`` and it joins the job
torchrun started (any number of nodes). Each rank trains on its slice of
every global batch and gradients are averaged through pc-comm.

The default corpus is the Python standard library's own source files read
as bytes (vocabulary 256), which every machine with Python has, so nothing is
downloaded. The model is a ``transformers`` GPT-2 built from a config with
random weights.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pc_comm import (
    DistContext,
    ReduceOp,
    TorchCommunicator,
    all_reduce_coalesced,
    init_distributed,
)

__all__ = ["MODEL_PRESETS", "TrainConfig", "load_byte_corpus", "main", "train"]

# name -> (n_embd, n_layer, n_head)
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt2-tiny": (64, 2, 4),
    "gpt2-small": (128, 4, 4),
    "gpt2-medium": (256, 6, 8),
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; the same on every rank."""

    model: str = "gpt2-tiny"
    steps: int = 200
    global_batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 20
    corpus_bytes: int = 2_000_000
    corpus: str | None = None  # a directory or file; None: the stdlib sources

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model {self.model!r}; expected one of {sorted(MODEL_PRESETS)}."
            )
        for name in ("steps", "global_batch_size", "seq_len", "log_every", "corpus_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")


def load_byte_corpus(source: str | None, limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of text as a 1-D int64 tensor of byte values.

    ``source`` is a file or a directory (its ``*.py``, ``*.txt`` and ``*.md``
    files, sorted); None reads the standard library's top-level modules.
    """
    root = Path(source) if source else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for ext in ("*.py", "*.txt", "*.md") for p in root.glob(ext))
    else:
        raise ValueError(f"corpus {str(root)!r} is neither a file nor a directory.")
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()[: limit - total]
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total == 0:
        raise ValueError(f"corpus {str(root)!r} holds no text files (*.py, *.txt, *.md).")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def _build_model(config: TrainConfig) -> nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit("pc-train needs transformers: pip install 'pc-booster[hf]'") from None
    n_embd, n_layer, n_head = MODEL_PRESETS[config.model]
    hf_config = GPT2Config(
        vocab_size=256,
        n_positions=config.seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,  # byte vocabulary: NUL stands in for both
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    torch.manual_seed(config.seed)
    model: nn.Module = GPT2LMHeadModel(hf_config)
    return model


def _batch_offsets(config: TrainConfig, step: int, corpus_len: int) -> torch.Tensor:
    """The global batch of one step: the same on every rank, so a rank's
    slice and a single process's full batch see the same data."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return torch.randint(0, corpus_len - config.seq_len, (config.global_batch_size,), generator=gen)


def _windows(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    index = offsets[:, None] + torch.arange(seq_len)[None, :]
    return tokens[index]


def train(config: TrainConfig, context: DistContext) -> dict[str, Any]:
    """Train on this rank; returns the loss history (every rank holds it)."""
    env, device = context.env, context.device
    if config.global_batch_size % env.world_size != 0:
        raise ValueError(
            f"global_batch_size ({config.global_batch_size}) must be divisible by the "
            f"number of ranks ({env.world_size})."
        )
    per_rank = config.global_batch_size // env.world_size
    comm = TorchCommunicator()
    corpus = load_byte_corpus(config.corpus, config.corpus_bytes)
    split = int(len(corpus) * 0.95)
    train_tokens, eval_tokens = corpus[:split], corpus[split:]

    model = _build_model(config).to(device)
    for param in model.parameters():  # identical replicas, whatever the seed did
        comm.broadcast(param.data, src=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / config.steps)),
    )
    eval_batch = _windows(
        eval_tokens,
        torch.linspace(0, len(eval_tokens) - config.seq_len - 1, 32).long(),
        config.seq_len,
    ).to(device)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=eval_batch, labels=eval_batch).loss
        model.train()
        return float(loss)

    history: dict[str, Any] = {"step": [], "loss": [], "eval_start": evaluate()}
    rank0 = env.rank == 0
    if rank0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"pc-train: {config.model} ({params / 1e6:.2f} M params) on {env.world_size} "
            f"{context.backend} rank(s), global batch {config.global_batch_size} x "
            f"{config.seq_len} bytes, {len(corpus) / 1e6:.1f} MB corpus",
            flush=True,
        )
    start = time.perf_counter()
    window_start, window_tokens = start, 0
    for step in range(config.steps):
        offsets = _batch_offsets(config, step, len(train_tokens))
        mine = offsets[env.rank * per_rank : (env.rank + 1) * per_rank]
        batch = _windows(train_tokens, mine, config.seq_len).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_coalesced(comm, grads, ReduceOp.AVG)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        schedule.step()
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, ReduceOp.AVG)
        history["step"].append(step)
        history["loss"].append(float(global_loss))
        window_tokens += config.global_batch_size * config.seq_len
        if rank0 and ((step + 1) % config.log_every == 0 or step == 0):
            now = time.perf_counter()
            rate = window_tokens / max(now - window_start, 1e-9)
            print(
                f"step {step + 1:>5}/{config.steps}  loss {float(global_loss):.4f}  "
                f"lr {schedule.get_last_lr()[0]:.2e}  {rate:,.0f} tokens/s",
                flush=True,
            )
            window_start, window_tokens = now, 0
    history["eval_end"] = evaluate()
    history["seconds"] = time.perf_counter() - start
    if rank0:
        head = sum(history["loss"][:10]) / min(10, len(history["loss"]))
        tail = sum(history["loss"][-10:]) / min(10, len(history["loss"]))
        print(
            f"done in {history['seconds']:.1f} s: train loss {head:.3f} -> {tail:.3f} "
            f"(mean of first / last 10 steps), held-out loss "
            f"{history['eval_start']:.3f} -> {history['eval_end']:.3f}",
            flush=True,
        )
    return history


def _worker(config: TrainConfig) -> None:
    context = init_distributed()
    if context.device.type == "cpu":
        # Ranks share the host's cores; oversubscribing them slows every rank.
        local = context.env.local_world_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        train(config, context)
    finally:
        torch.distributed.destroy_process_group()


def _parse(argv: Sequence[str] | None) -> tuple[TrainConfig, int]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="pc-train",
        description="Train a small GPT-2 data-parallel on local processes or under torchrun.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="local processes to start (default 2)")
    parser.add_argument("--model", default=defaults.model, choices=sorted(MODEL_PRESETS))
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--global-batch-size", type=int, default=defaults.global_batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument(
        "--corpus", default=None, help="a text file or directory (default: Python's stdlib)"
    )
    parser.add_argument("--corpus-bytes", type=int, default=defaults.corpus_bytes)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    fields = {k: v for k, v in vars(args).items() if k != "nproc"}
    try:
        config = TrainConfig(**fields)
    except ValueError as error:
        parser.error(str(error))
    if "RANK" not in os.environ and config.global_batch_size % args.nproc != 0:
        parser.error(
            f"--global-batch-size ({config.global_batch_size}) must be divisible by "
            f"--nproc ({args.nproc})"
        )
    return config, args.nproc


def main(argv: Sequence[str] | None = None) -> None:
    config, nproc = _parse(argv)
    if "RANK" in os.environ:  # started by torchrun: join its job
        _worker(config)
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"pc-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    print(f"pc-train: starting {nproc} local process(es); config {asdict(config)}", flush=True)
    elastic_launch(launch, _worker)(config)


if __name__ == "__main__":
    main()
