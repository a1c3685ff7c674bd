"""Collectives built from a :class:`~pc_comm.communicator.Communicator`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pc_comm.communicator import Communicator, Handle, ReduceOp

__all__ = ["all_reduce_coalesced"]


class _CoalescedHandle:
    """Waits on one flat all-reduce per dtype, then copies each flat result
    back into the tensors it was packed from."""

    def __init__(self, pending: list[tuple[Handle, torch.Tensor, list[torch.Tensor]]]) -> None:
        self._pending = pending  # (handle, flat buffer, tensors packed into it)
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        for handle, flat, tensors in self._pending:
            handle.wait(timeout)
            offset = 0
            for tensor in tensors:
                count = tensor.numel()
                tensor.copy_(flat[offset : offset + count].view_as(tensor))
                offset += count
        self._done = True

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h, _, _ in self._pending)


def all_reduce_coalesced(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    *,
    async_op: bool = False,
) -> Handle:
    """All-reduce many tensors with one collective per dtype and device.

    Small tensors (biases, norms) each cost a full network round trip when
    reduced one by one; packing them into one flat buffer pays it once. The
    tensors are updated in place when the returned handle's ``wait()``
    returns (before this function returns when ``async_op`` is False).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    pending = []
    for members in groups.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        pending.append((comm.all_reduce(flat, op, async_op=True), flat, members))
    handle = _CoalescedHandle(pending)
    if not async_op:
        handle.wait()
    return handle
