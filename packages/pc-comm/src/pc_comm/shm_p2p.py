"""Point-to-point sends and receives through shared memory.

[Note: point-to-point through shared memory]
Every ordered pair of ranks (src, dst) owns a ring of ``slots`` pieces of
``slot_bytes`` in one shared segment, and two counters on their own lines:
``written`` (only src stores it) and ``read`` (only dst stores it). A
message moves in pieces: src waits until the ring has a free slot
(``written - read < slots``), copies a piece in and bumps ``written``; dst
waits until ``written > read``, copies the piece out and bumps ``read``. On
x86-64 a store becomes visible only after the stores before it (TSO), so a
counter seen means the piece it counts is there.

Sends and receives are queued per peer, in the order they were posted.
There is no background thread: the calling thread moves data whenever it
posts, polls or waits, and each time it moves whatever can move on every
queue, so a send waiting for ring space never holds up a receive and
posted operations cannot deadlock each other. A rank thus spends no CPU on
communication while it computes (on a small host a polling thread would
take cores from compute); data a peer sent meanwhile waits in the ring.
Messages between two ranks match first in, first out, as with NCCL and
gloo; both sides must agree on each message's size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pc_comm.communicator import P2PKind

__all__ = ["P2PChannels", "P2PHandle"]

_LINE_INT64 = 16  # 128-byte lines: counters of different writers never share one


# (peer, what, timed out after these seconds or None) -> the error to raise, or None
_Failure = Callable[[int, str, float | None], Exception | None]


@dataclass
class _Op:
    kind: P2PKind
    peer: int
    data: torch.Tensor  # flat uint8 view of the caller's contiguous tensor
    moved: int = 0  # bytes done
    done: bool = False


class P2PHandle:
    """A posted send or receive; ``wait`` moves data until its bytes moved."""

    def __init__(self, channels: P2PChannels, op: _Op) -> None:
        self._channels = channels
        self._op = op

    def wait(self, timeout: float | None = None) -> None:
        self._channels.drive(self._op, timeout)

    def is_completed(self) -> bool:
        if not self._op.done:
            self._channels.advance()
        return self._op.done


class P2PChannels:
    """The rings of one shared-memory communicator and their progress thread.

    ``segment`` must be at least :meth:`segment_bytes` long and zero-filled,
    mapped at the same place by every rank."""

    def __init__(
        self, segment: torch.Tensor, rank: int, world: int, slot_bytes: int, slots: int
    ) -> None:
        self.rank, self.world = rank, world
        self.slot_bytes, self.slots = slot_bytes, slots
        lines = 2 * world * world
        control_bytes = lines * _LINE_INT64 * 8
        self._counters = segment[:control_bytes].view(torch.int64).view(lines, _LINE_INT64)[:, 0]
        self._data = segment[control_bytes:]
        self._written = [0] * world  # what this rank wrote to each dst
        self._read = [0] * world  # what this rank read from each src
        self._sends: list[deque[_Op]] = [deque() for _ in range(world)]
        self._recvs: list[deque[_Op]] = [deque() for _ in range(world)]
        self._lock = threading.Lock()  # one thread moves data at a time
        self._failure: _Failure | None = None
        self._check_every = 0.05

    def watch(self, failure: _Failure, every: float) -> None:
        """While a send or receive waits, ask ``failure(peer, what,
        timed_out)`` every ``every`` seconds whether its peer is gone (and,
        with ``timed_out`` set to the seconds waited, for the error to raise
        once the wait's timeout passed); raise what it returns."""
        self._failure, self._check_every = failure, every

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int, slots: int) -> int:
        return 2 * world * world * _LINE_INT64 * 8 + world * world * slots * slot_bytes

    def _written_line(self, src: int, dst: int) -> int:
        return 2 * (src * self.world + dst)

    def _slot(self, src: int, dst: int, index: int, nbytes: int) -> torch.Tensor:
        start = ((src * self.world + dst) * self.slots + index % self.slots) * self.slot_bytes
        return self._data[start : start + nbytes]

    def post(self, kind: P2PKind, tensor: torch.Tensor, peer: int) -> P2PHandle:
        flat = tensor.reshape(-1).view(torch.uint8)
        op = _Op(kind, peer, flat)
        if flat.numel() == 0:
            op.done = True
            return P2PHandle(self, op)
        with self._lock:
            (self._sends if kind is P2PKind.SEND else self._recvs)[peer].append(op)
        self.advance()  # often the whole message moves right here
        return P2PHandle(self, op)

    def close(self) -> None:
        """Nothing runs in the background; kept for symmetry with the
        communicator's other resources."""

    def advance(self) -> bool:
        """Move what can move on every queue; True if anything moved."""
        progressed = False
        with self._lock:
            for queues, step in (
                (self._sends, self._advance_send),
                (self._recvs, self._advance_recv),
            ):
                for peer, queue in enumerate(queues):
                    while queue:
                        op = queue[0]
                        progressed |= step(peer, op)
                        if op.moved < op.data.numel():
                            break
                        op.done = True
                        queue.popleft()
        return progressed

    def drive(self, op: _Op, timeout: float | None) -> None:
        """Move data until ``op`` is done. Raises the watcher's error (see
        :meth:`watch`) as soon as the peer is gone, and when ``timeout``
        passes (else TimeoutError)."""
        start = time.monotonic()
        next_check = start + self._check_every
        pause = 0.0
        while not op.done:
            if self.advance():
                pause = 0.0
                continue
            now = time.monotonic()
            timed_out = timeout is not None and now - start > timeout
            if self._failure is not None and (timed_out or now > next_check):
                what = f"{op.kind.value} of {op.data.numel()} bytes with rank {op.peer}"
                error = self._failure(op.peer, what, timeout if timed_out else None)
                if error is not None:
                    raise error
                next_check = now + self._check_every
            if timed_out:
                raise TimeoutError(
                    f"shared-memory {op.kind.value} with rank {op.peer} not completed "
                    f"within {timeout} s"
                )
            time.sleep(pause)  # yield first: the peer is often one step away
            pause = min(max(pause * 2, 5e-6), 2e-4)

    def _advance_send(self, dst: int, op: _Op) -> bool:
        moved = False
        read_line = self._written_line(self.rank, dst) + 1
        while op.moved < op.data.numel():
            if self._written[dst] - int(self._counters[read_line]) >= self.slots:
                break  # ring full: the receiver has not caught up
            size = min(self.slot_bytes, op.data.numel() - op.moved)
            self._slot(self.rank, dst, self._written[dst], size).copy_(
                op.data[op.moved : op.moved + size]
            )
            self._written[dst] += 1
            self._counters[read_line - 1] = self._written[dst]  # after the data [Note]
            op.moved += size
            moved = True
        return moved

    def _advance_recv(self, src: int, op: _Op) -> bool:
        moved = False
        written_line = self._written_line(src, self.rank)
        while op.moved < op.data.numel():
            if int(self._counters[written_line]) <= self._read[src]:
                break  # nothing new from the sender
            size = min(self.slot_bytes, op.data.numel() - op.moved)
            op.data[op.moved : op.moved + size].copy_(
                self._slot(src, self.rank, self._read[src], size)
            )
            self._read[src] += 1
            self._counters[written_line + 1] = self._read[src]
            op.moved += size
            moved = True
        return moved
