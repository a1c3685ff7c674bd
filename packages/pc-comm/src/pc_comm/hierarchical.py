"""Collectives across nodes: shared memory inside a node, torch.distributed
between nodes.

[Note: two levels]
The L ranks of a node talk through a :class:`~pc_comm.shm.ShmCommunicator`;
the N ranks that hold the same local index on different nodes talk through a
gloo group (host memory; hfreduce's inter-node step). An all-reduce is a
shared-memory reduce-scatter (local rank l ends up with the node's sum of
slice l), an inter-node all-reduce of that slice, and a shared-memory
all-gather. Each local rank so carries 1/L of the inter-node traffic, and
the L inter-node all-reduces run side by side. Reduce-scatter and all-gather
use the same two levels, with the chunks permuted so that each level moves
contiguous memory.

[Note: finding the nodes]
In order of precedence: ``local_size=`` given to the constructor (ranks
``[k * local_size, (k + 1) * local_size)`` of the group form node k); then
torchrun's ``GROUP_RANK`` (the agent's index: one agent per node); then
``RANK // LOCAL_WORLD_SIZE``; then the host name. Every node must hold the
same number of the group's ranks.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pc_comm._host import HostExecutor, padded
from pc_comm.communicator import (
    Handle,
    P2POp,
    ReduceOp,
    divide_for_average,
)
from pc_comm.shm import ShmCommunicator
from pc_comm.torch_communicator import TorchCommunicator

__all__ = ["HierarchicalCommunicator", "node_key"]


def node_key(
    group_rank: int, local_size: int | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The name of this rank's node [Note: finding the nodes]."""
    env = os.environ if environ is None else environ
    if local_size is not None:
        return f"block {group_rank // local_size}"
    if "GROUP_RANK" in env:
        return f"agent {env['GROUP_RANK']}"
    if "LOCAL_WORLD_SIZE" in env and "RANK" in env:
        return f"block {int(env['RANK']) // int(env['LOCAL_WORLD_SIZE'])}"
    return f"host {platform.node()}"


class HierarchicalCommunicator(HostExecutor):
    """A :class:`~pc_comm.communicator.Communicator` over several nodes
    [Note: two levels].

    ``group`` (default: the world) is the set of ranks; ``local_size`` fixes
    how many consecutive ranks share a node (otherwise they are found from
    torchrun's environment, [Note: finding the nodes]). ``slot_bytes`` and
    ``timeout`` go to the shared-memory level (default timeout: the default
    process group's). Operations run on one worker
    thread in call order; CUDA tensors are staged through pinned host memory.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        local_size: int | None = None,
        slot_bytes: int = 16 * 1024 * 1024,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "HierarchicalCommunicator needs an initialised process group; "
                "call pc_comm.init_distributed() first."
            )
        world = dist.group.WORLD
        assert world is not None
        self.group: dist.ProcessGroup = group if group is not None else world
        self._rank = dist.get_rank(self.group)
        self._world_size = dist.get_world_size(self.group)
        if local_size is not None and (local_size < 1 or self._world_size % local_size):
            raise ValueError(
                f"local_size must divide the group's size {self._world_size}; got {local_size}."
            )
        members = dist.get_process_group_ranks(self.group)  # global rank of each group rank
        keys: list[str] = [""] * self._world_size
        dist.all_gather_object(keys, node_key(self._rank, local_size), group=self.group)
        self.nodes = _split_nodes(keys)
        self.local_size = len(self.nodes[0])
        self.num_nodes = len(self.nodes)
        self._local = {r: node.index(r) for node in self.nodes for r in node}
        # cross[l]: the group ranks with local index l, in group-rank order
        # (the order torch gives the ranks of a subgroup).
        self._cross = [sorted(node[i] for node in self.nodes) for i in range(self.local_size)]
        my_node = next(node for node in self.nodes if self._rank in node)
        # Every rank creates every subgroup, in the same order, as torch requires.
        node_group = cross_group = None
        for node in self.nodes:
            made = dist.new_group([members[r] for r in node], backend="gloo")
            if node is my_node:
                node_group = made
        for local, ranks in enumerate(self._cross):
            made = dist.new_group([members[r] for r in ranks], backend="gloo")
            if local == self._local[self._rank]:
                cross_group = made
        assert node_group is not None
        assert cross_group is not None
        self.intra = ShmCommunicator(node_group, slot_bytes=slot_bytes, timeout=timeout)
        self.inter = TorchCommunicator(cross_group)
        self._full = TorchCommunicator(self.group)
        # Chunk order that makes both levels contiguous: row (l, k) is the
        # chunk of rank cross[l][k].
        self._order = [r for ranks in self._cross for r in ranks]
        HostExecutor.__init__(self, "pc-hier-comm")

    def __repr__(self) -> str:
        return (
            f"HierarchicalCommunicator(rank={self._rank}, nodes={self.num_nodes}, "
            f"local_size={self.local_size})"
        )

    def close(self) -> None:
        HostExecutor.close(self)
        self.intra.close()

    # -- host-side algorithms (run on the worker thread) -----------------------

    def _level_op(self, op: ReduceOp) -> ReduceOp:
        return ReduceOp.SUM if op is ReduceOp.AVG else op

    def _finish_avg(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if op is ReduceOp.AVG:
            divide_for_average(tensor, self._world_size)

    def _host_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> None:
        level = self._level_op(op)
        chunk = -(-flat.numel() // self.local_size)
        whole = padded(flat, chunk * self.local_size)
        part = whole.new_empty(chunk)
        self.intra.reduce_scatter(part, whole, level)
        self.inter.all_reduce(part, level)
        self._finish_avg(part, op)
        self.intra.all_gather(whole, part)
        if whole is not flat:
            flat.copy_(whole[: flat.numel()])

    def _host_reduce_scatter(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        level = self._level_op(op)
        staged = torch.cat([chunks[r] for r in self._order])  # [Note: two levels]
        part = out.new_empty(self.num_nodes * out.numel())
        self.intra.reduce_scatter(part, staged, level)
        self.inter.reduce_scatter(out, part, level)
        self._finish_avg(out, op)

    def _host_all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        slot = max(out.numel() for out in outs)
        mine = padded(inp, slot)
        across = inp.new_empty(self.num_nodes * slot)
        self.inter.all_gather(across, mine)
        everything = inp.new_empty(self._world_size * slot)
        self.intra.all_gather(everything, across)
        rows = everything.view(self._world_size, slot)
        for row, rank in enumerate(self._order):
            outs[rank].copy_(rows[row, : outs[rank].numel()])

    def _host_broadcast(self, flat: torch.Tensor, src: int) -> None:
        local = self._local[src]
        if self._local[self._rank] == local:
            self.inter.broadcast(flat, self._cross[local].index(src))
        self.intra.broadcast(flat, local)

    # -- the rest of the Communicator protocol ----------------------------

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Handle:
        return self._full.send(tensor, dst, async_op=async_op)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle:
        return self._full.recv(tensor, src, async_op=async_op)

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        return self._full.batch_p2p(ops)

    def barrier(self) -> None:
        self._submit(self._full.barrier, async_op=False)


def _split_nodes(keys: Sequence[str]) -> list[list[int]]:
    """Group ranks by node key, nodes ordered by their lowest rank; every node
    must have the same number of ranks."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    sizes = {key: len(ranks) for key, ranks in nodes.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(
            "HierarchicalCommunicator needs the same number of ranks on every node; "
            f"found {sizes}. Launch the same --nproc-per-node everywhere, or pass local_size=."
        )
    return list(nodes.values())
