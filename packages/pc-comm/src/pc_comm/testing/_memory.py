"""What a rank holds in host memory, counted from outside the library:
every live tensor's storage, and the shared-memory segments the ranks of a
node map together [Note: counting a rank's host memory]."""

from __future__ import annotations

import gc
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HostMemory", "host_memory"]

# [Note: counting a rank's host memory]
# Private: every tensor the interpreter can reach (``gc.get_objects``), plus
# each leaf's ``.grad`` (held by autograd, not by a Python object until read),
# deduplicated by storage, CPU storages only, leaving out storages that lie in
# a shared segment. Allocator slack and freed-but-kept pages are not tensors
# and are not counted: this is what the library keeps alive, which is what
# the ZeRO paper's formulas describe.
# Shared: every ``/dev/shm`` segment this process maps (pc-comm's are
# unlinked once mapped, so they are found through /proc/self/map_files), by
# the pages the file system gave the segment: a sparse ring no rank wrote to
# costs nothing, a page any rank wrote counts once for the node. The node's
# total over its ranks is what each rank carries.

_SEGMENT = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+\s+(/dev/shm/\S+)")


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of one rank: ``private`` (its own live tensor storages)
    and the node's shared segments, counted once for the node, by kind:
    ``symmetric`` (pc-comm's symmetric buffers: model states a plugin keeps
    there), ``slots`` (a communicator's control lines and staging slots),
    ``other`` (point-to-point rings and any other segment in /dev/shm)."""

    private: int
    symmetric: int
    slots: int
    other: int
    local_ranks: int

    @property
    def node_shared(self) -> int:
        return self.symmetric + self.slots + self.other

    @property
    def per_rank(self) -> int:
        """Private bytes plus this rank's share of the node's segments."""
        return self.private + self.node_shared // max(1, self.local_ranks)

    @property
    def states_per_rank(self) -> int:
        """What the ZeRO paper's formulas count: private bytes, this rank's
        share of the symmetric buffers and of the rings."""
        return self.private + (self.symmetric + self.other) // max(1, self.local_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.slots // max(1, self.local_ranks)


def _segments() -> list[tuple[int, int, int, str]]:
    """(start, end, allocated bytes, file name) of each shared segment
    mapping, the allocated bytes once per file."""
    found: list[tuple[int, int, int, str]] = []
    seen: set[tuple[int, int]] = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        match = _SEGMENT.match(line)
        if match is None:
            continue
        start, end = int(match.group(1), 16), int(match.group(2), 16)
        try:
            info = os.stat(f"/proc/self/map_files/{match.group(1)}-{match.group(2)}")
        except OSError:
            continue
        key = (info.st_dev, info.st_ino)
        allocated = 0 if key in seen else info.st_blocks * 512
        seen.add(key)
        found.append((start, end, allocated, match.group(3)))
    return found


def _live_cpu_storages() -> dict[int, int]:
    found: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated module objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    tensors += [t.grad for t in tensors if t.grad is not None]
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_sparse:
            continue
        try:
            storage = tensor.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without real storage
            continue
        if nbytes:
            found[address] = nbytes
    return found


def host_memory(local_ranks: int) -> HostMemory:
    """This rank's host memory [Note: counting a rank's host memory];
    ``local_ranks`` is how many ranks of its node share its segments."""
    segments = _segments()
    private = sum(
        nbytes
        for address, nbytes in _live_cpu_storages().items()
        if not any(start <= address < end for start, end, *_ in segments)
    )
    kinds = {"symmetric": 0, "slots": 0, "other": 0}
    for *_, allocated, name in segments:
        kind = name.removesuffix(" (deleted)").rsplit("-", 1)[-1]
        kinds[kind if kind in kinds else "other"] += allocated
    return HostMemory(private, **kinds, local_ranks=local_ranks)
