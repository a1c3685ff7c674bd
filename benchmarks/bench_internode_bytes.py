"""Bytes per rank over the links between nodes, per training step: full
sharding against two-level sharding (issue 43), at a simulated 2 nodes x 2
ranks and 2 nodes x 4, counted from the collectives each plugin issues and
compared with the formula. Nothing is timed.

Every collective a step issues is recorded, torch.distributed's (FSDP2) and
pc-comm's communicators' (ZeRO, Gemini), with its group and size (nested
calls, a communicator calling torch, counted once). Rank r sits on node
r // ranks_per_node. A collective over a group spanning k nodes with m of
its ranks on each moves, with a node-aware algorithm (hierarchical: a
node's ranks combine inside the node, then each node exchanges what the
others lack), (k - 1) / k of its data S across nodes, split over the m
ranks of a node: all-gather and reduce-scatter (k - 1) / k * S / m per
rank, all-reduce twice that. A group inside one node moves nothing across.

The formula, per rank and step, for Psi trainable parameters of b bytes on
K nodes of M ranks (k = K, m = M for the whole world; the replica groups
of two-level sharding have one rank on each node, m = 1, and hold 1/M of
the gradients):

======================  ===============================  =================
plugin                  full sharding over every rank     two-level
======================  ===============================  =================
FSDP2 / Gemini (ZeRO-3) 3 (K-1)/K Psi b / M              2 (K-1)/K Psi b / M
                        (gather in forward and backward,  (the gradient
                        reduce-scatter the gradients)     shard's all-reduce)
ZeRO-2                  2 (K-1)/K Psi b / M              2 (K-1)/K Psi b / M
======================  ===============================  =================

FSDP2's root unit (embeddings, final norm) is not gathered again in
backward, so its measured bytes sit below 3 x by that unit's share; the
table gives both. With gradient accumulation over A micro-batches full
ZeRO-3 gathers every micro-batch: (2A + 1) units against 2.

Run: ``python benchmarks/bench_internode_bytes.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchFSDPPlugin
from pc_comm.testing import spawn, tiny_gpt2

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
_local = threading.local()
# (operation, group's global ranks, bytes of the whole collective)
_calls: list[tuple[str, tuple[int, ...], int]] = []


def _ranks(group: Any) -> tuple[int, ...]:
    pg = getattr(group, "group", group)  # a pc-comm communicator keeps its group
    if pg is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(pg))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _recorded(op: str, fn: Callable[..., Any], size: Callable[..., int], group_at: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "inside", False):
            return fn(*args, **kwargs)
        _local.inside = True
        try:
            group = group_at(args, kwargs)
            _calls.append((op, _ranks(group), size(*args, **kwargs)))
            return fn(*args, **kwargs)
        finally:
            _local.inside = False

    return wrapper


def _install() -> None:
    """Record torch.distributed's collectives and pc-comm's communicators'."""
    from pc_comm import ShmCommunicator, TorchCommunicator
    from pc_comm.hierarchical import HierarchicalCommunicator

    def kw_group(args: Any, kwargs: Any) -> Any:
        return kwargs.get("group")

    def arg(index: int, keyword: str) -> Callable[..., int]:
        """The size of the argument at ``index`` or named ``keyword``."""

        def size(*args: Any, **kwargs: Any) -> int:
            return _nbytes(kwargs[keyword] if keyword in kwargs else args[index])

        return size

    # (recorded as, the argument holding the whole collective's data)
    torch_ops: dict[str, tuple[str, Callable[..., int]]] = {
        "all_reduce": ("all_reduce", arg(0, "tensor")),
        "all_gather_into_tensor": ("all_gather", arg(0, "output_tensor")),
        "all_gather_single": ("all_gather", arg(0, "output_tensor")),  # FSDP2's
        "reduce_scatter_tensor": ("reduce_scatter", arg(1, "input")),
        "reduce_scatter_single": ("reduce_scatter", arg(1, "input")),  # FSDP2's
        "all_gather": ("all_gather", arg(0, "tensor_list")),
        "reduce_scatter": ("reduce_scatter", arg(1, "input_list")),
        "broadcast": ("broadcast", arg(0, "tensor")),
    }
    for name, (op, size) in torch_ops.items():
        if hasattr(dist, name):
            setattr(dist, name, _recorded(op, getattr(dist, name), size, kw_group))

    def self_group(args: Any, kwargs: Any) -> Any:
        return args[0]

    comm_ops: dict[str, tuple[str, Callable[..., int]]] = {
        "all_reduce": ("all_reduce", lambda self, t, *a, **k: _nbytes(t)),
        "reduce_scatter": ("reduce_scatter", lambda self, out, inp, *a, **k: _nbytes(inp)),
        "reduce_scatter_list": ("reduce_scatter", lambda self, out, ins, *a, **k: _nbytes(ins)),
        "all_gather": ("all_gather", lambda self, out, inp, *a, **k: _nbytes(out)),
        "all_gather_list": ("all_gather", lambda self, outs, inp, *a, **k: _nbytes(outs)),
        "broadcast": ("broadcast", lambda self, t, *a, **k: _nbytes(t)),
    }
    for cls in (ShmCommunicator, TorchCommunicator, HierarchicalCommunicator):
        for name, (op, size) in comm_ops.items():
            if hasattr(cls, name):
                setattr(cls, name, _recorded(op, getattr(cls, name), size, self_group))


def internode_bytes(op: str, ranks: tuple[int, ...], nbytes: int, per_node: int) -> float:
    """Bytes per rank of the group that cross nodes, node-aware [module doc]."""
    nodes = {r // per_node for r in ranks}
    k = len(nodes)
    if k == 1:
        return 0.0
    m = len(ranks) / k
    share = (k - 1) / k * nbytes / m
    if op == "all_reduce":
        return 2 * share
    if op == "broadcast":
        return (k - 1) * nbytes / len(ranks)
    return share


def _plugin(name: str, nodes: int, per_node: int) -> Plugin:
    plugins: dict[str, Callable[[], Plugin]] = {
        "fsdp2 full": lambda: TorchFSDPPlugin(),
        "fsdp2 hybrid": lambda: TorchFSDPPlugin(sharding_strategy="HYBRID_SHARD"),
        "zero2 full": lambda: LowLevelZeroPlugin(stage=2),
        "zero2 two-level": lambda: LowLevelZeroPlugin(stage=2, extra_dp_size=nodes),
        "gemini full": lambda: GeminiPlugin(),
        "gemini two-level": lambda: GeminiPlugin(extra_dp_size=nodes),
    }
    return plugins[name]()


PLUGINS = [
    "fsdp2 full", "fsdp2 hybrid", "zero2 full", "zero2 two-level", "gemini full",
    "gemini two-level",
]  # fmt: skip


def formula(name: str, psi_bytes: float, nodes: int, per_node: int) -> float:
    unit = (nodes - 1) / nodes * psi_bytes / per_node
    if name.startswith("zero2"):
        return 2 * unit
    return 2 * unit if ("hybrid" in name or "two-level" in name) else 3 * unit


def _count(out: str, nodes: int, per_node: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # FSDP2's hybrid shards over a "node"
    _install()
    rows = []
    for name in PLUGINS:
        torch.manual_seed(0)
        model = tiny_gpt2(positions=32, n_embd=64, n_layer=4)
        psi_bytes = sum(p.numel() * 4 for p in model.parameters())
        booster = Booster(plugin=_plugin(name, nodes, per_node))
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))

        for _ in range(2):  # the first a warm-up (lazy buffers, first gathers)
            _calls.clear()
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
        cross = sum(internode_bytes(op, r, n, per_node) for op, r, n in _calls)
        spanning = sum(1 for _, r, _ in _calls if len({x // per_node for x in r}) > 1)
        total = torch.tensor([cross], dtype=torch.float64)
        dist.all_reduce(total)
        rows.append(
            {
                "plugin": name,
                "measured": float(total) / dist.get_world_size(),
                "formula": formula(name, psi_bytes, nodes, per_node),
                "psi_bytes": psi_bytes,
                "collectives": len(_calls),
                "internode_collectives": spanning,
            }
        )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    lines = [
        "| layout | plugin | measured MiB/rank/step | formula | measured / formula "
        "| collectives spanning nodes / all |",
        "|---|---|---|---|---|---|",
    ]
    for nodes, per_node in ((2, 2), (2, 4)):
        out = RESULTS / f"internode_bytes_{nodes}x{per_node}.json"
        spawn(_count, nodes * per_node, args=(str(out), nodes, per_node), timeout=600)
        for row in json.loads(out.read_text()):
            mib, want = row["measured"] / 2**20, row["formula"] / 2**20
            lines.append(
                f"| {nodes} x {per_node} | {row['plugin']} | {mib:.3f} | {want:.3f} | "
                f"{row['measured'] / row['formula']:.3f} | "
                f"{row['internode_collectives']} / {row['collectives']} |"
            )
    table = "\n".join(lines)
    print(table)
    (RESULTS / "internode_bytes.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
