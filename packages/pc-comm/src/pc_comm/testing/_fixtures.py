"""Small models and launchers that tests across the pc packages share."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["run_torchrun_agents", "tiny_gpt2"]


def tiny_gpt2(vocab_size: int = 97, positions: int = 16, **overrides: Any) -> nn.Module:
    """A 2-layer, 32-wide GPT-2 without dropout, so runs are deterministic.
    Needs transformers (``pip install pc-booster[hf]``)."""
    import transformers

    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "n_positions": positions,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "loss_type": "ForCausalLM",
    }
    settings.update(overrides)
    model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))
    return model


@contextmanager
def one_process_group() -> Iterator[None]:
    """A gloo group of one, in this process, for code that needs an
    initialised group but no peers (option checks, fuzzing)."""
    from pc_comm.testing._harness import find_free_port

    port = find_free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_torchrun_agents(
    script: Path,
    *,
    nodes: int,
    nproc_per_node: int,
    port: int,
    logs: Path,
    timeout: float,
    run_id: str = "pc-test",
) -> tuple[list[int | None], str]:
    """Start one torchrun agent per simulated node on this machine, running
    ``script``; return their exit codes and their combined output. Output goes
    to files in ``logs``, not pipes: an agent blocked on a full pipe that
    nobody drains would stall its ranks and hang the other nodes."""
    procs, files = [], []
    for node in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node)),
            *("--node-rank", str(node), "--max-restarts", "0"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--rdzv-id", run_id),
            str(script),
        ]
        log = logs / f"agent{node}.log"
        files.append(log)
        with log.open("w") as sink:
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            proc.kill()
    return [proc.returncode for proc in procs], "".join(f.read_text() for f in files)


def assert_exits_cleanly(script: Path, runs: int, timeout: float = 120.0) -> None:
    """Run ``script`` in a fresh interpreter ``runs`` times; each run must
    exit with status 0 and without "terminate called" (a C++ abort at
    teardown) on stderr. For failures that happen in some runs only, so a
    test repeats the run ([Note: threads at interpreter exit])."""
    for attempt in range(runs):
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout
        )
        tail = done.stderr[-2000:]
        assert done.returncode == 0, f"run {attempt + 1}: exit status {done.returncode}\n{tail}"
        assert "terminate called" not in done.stderr, f"run {attempt + 1}: C++ abort\n{tail}"


@contextmanager
def small_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A file system of its own at ``path`` for the block (a tmpfs mounted
    with ``options``, e.g. ``size=4m`` or ``size=1m,ro``): the disk-full and
    read-only tests. Needs root; skips the test (``unittest.SkipTest``, which
    pytest honours) where the mount is refused."""
    import unittest

    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        raise unittest.SkipTest(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def saved_storage_bytes(output: torch.Tensor) -> dict[int, int]:
    """Every storage autograd saved for the backward of ``output``, by
    address: its bytes now (0 for a storage freed in place). What a rank
    holds between forward and backward, counted from outside; reading a
    saved tensor under activation recomputation would recompute it, so
    count there before a recomputing forward is asked for."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[Any] = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # released already
                    continue
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    found[storage.data_ptr()] = storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
