"""Ring attention (``sequence_parallelism_mode="ring_attn"``, torch's ``context_parallel``)
for ``transformers`` models: each rank of a sequence-parallel group keeps
its queries and passes key/value blocks around the ring, one step per
rank, combining the partial softmax results exactly by their log-sum-exp.

Under causal attention the sequence is split zig-zag: in ``2 * sp`` blocks,
rank ``r`` holds blocks ``r`` and ``2 * sp - 1 - r``, an early and a late
one, so every rank has the same amount of attention to compute. A query
block attends to key blocks before it whole, to its own block causally,
and skips those after it.

``ring_model(model, group)`` does it in place, as
:func:`~pc_tensor.ulysses_model` does for Ulysses: an attention
implementation registered with transformers' attention interface, and a
forward that takes the whole batch and returns the whole sequence's loss;
:func:`~pc_tensor.sync_sequence_grads` sums the gradients over the group.

Memory: forward and backward are written by hand (one autograd
function for the whole ring), so what a rank keeps for backward is its own
queries, keys, values, output and log-sum-exp: its share of the sequence,
1/sp of the whole. Backward passes the key/value blocks round the ring a
second time, each with its gradient travelling beside it and summed on
the way, arriving home after the last step. One pair of blocks' scores
exists at a time; on the CPU each pair runs torch's fused attention kernel
(which returns the log-sum-exp and takes it back in backward), elsewhere
matrix products in float32.
Communication: the next key/value block is sent and received while the
current one is computed; in backward, so is the previous step's gradient.
The blocks go through pc-comm's shared memory when the group is on one
host and they are on the CPU, through ``torch.distributed`` otherwise.

Grouped-query attention: key/value heads travel as they are and are
repeated to the query heads inside each step. Refused as for Ulysses:
attention dropout, sliding windows shorter than the sequence, soft-capping,
padding masks, a sequence that does not split into ``2 * sp`` blocks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.sequence import group_for_attention, prepare, prepared_group, refuse_unsupported

__all__ = ["RING_ATTENTION", "prepare_links", "ring_attention", "ring_model"]

RING_ATTENTION = "pc_ring"


class _Links:
    """The ring's point-to-point links over ``group``: pc-comm's shared
    memory (``ShmCommunicator``) when every rank of the group is on this
    host and the blocks are on the CPU; ``torch.distributed`` otherwise
    (NCCL between GPUs, gloo between hosts). Made once per model (a
    collective over the group), shared by its attention modules."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        from pc_comm import ShmCommunicator, on_one_host

        self.group = group
        self.shm: Any = None
        if dist.get_world_size(group) > 1 and on_one_host(group):
            self.shm = ShmCommunicator(group)
        from pc_comm.health import group_timeout

        self.timeout = group_timeout()  # a shared-memory wait's bound

    def wait(self, handles: list[Any]) -> None:
        for handle in handles:
            if isinstance(handle, dist.Work):
                handle.wait()  # torch's: the group's own timeout
            else:
                handle.wait(self.timeout)

    def exchange(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Start sending ``x`` to the next rank of the ring and receiving the
        previous rank's; returns the receive buffer and the handles to wait
        on. Every rank posts its exchanges in one order (the shared-memory
        rings match messages first in, first out; torch's by ``tag``)."""
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):  # shape inference: nothing may be posted
            raise RuntimeError("ring attention exchanges real tensors, not fake ones.")
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        x = x.contiguous()
        got = torch.empty_like(x)
        after, before = (rank + 1) % world, (rank - 1) % world
        if self.shm is not None and x.device.type == "cpu":
            from pc_comm import P2PKind, P2POp

            ops = [P2POp(P2PKind.SEND, x, after), P2POp(P2PKind.RECV, got, before)]
            return got, list(self.shm.batch_p2p(ops))
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x, dist.get_global_rank(group, after), group, tag),
                dist.P2POp(dist.irecv, got, dist.get_global_rank(group, before), group, tag),
            ]
        )
        return got, list(requests)


# Every module of a model prepared for ring attention -> its ring's links
# (pc-tensor's record, as pc_tensor.sequence keeps the groups).
_LINKS: weakref.WeakKeyDictionary[nn.Module, _Links] = weakref.WeakKeyDictionary()


def _fused(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention (which returns the log-sum-exp
    and takes it back in backward) runs these blocks; elsewhere the blocks
    are computed by matrix products, one score matrix at a time."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The dtype partial results are kept and combined in: float32, or
    float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to the query heads (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _unrepeat(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`: each group's heads summed."""
    if grad.shape[1] == heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, heads, h // heads, s, d).sum(2)


def _above_diagonal(scores: torch.Tensor) -> torch.Tensor:
    size = scores.shape[-1]
    return torch.ones(size, size, dtype=torch.bool, device=scores.device).triu(1)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block over one key/value block (``diagonal``:
    the same block, causally masked): the output in float32 and the
    log-sum-exp of the scores, ``[batch, heads, tokens, 1]``."""
    k, v = _repeat(k, q.shape[1]), _repeat(v, q.shape[1])
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diagonal, scale=scale
        )
        return out.to(_acc(q)), lse.to(_acc(q)).unsqueeze(-1)
    scores = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-1, -2)) * scale
    if diagonal:
        scores.masked_fill_(_above_diagonal(scores), -torch.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(scores.sub_(lse).exp_(), v.to(_acc(q))), lse


def _block_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float, diagonal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of one block pair, given the whole attention's output
    and log-sum-exp for these queries (the softmax of a block is its scores
    less the whole row's log-sum-exp): ``dq`` in float32, and ``dk``, ``dv``
    in float32 over the key/value heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _repeat(k, heads), _repeat(v, heads)
    if _fused(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.to(q.dtype), q, k, v, out.to(q.dtype), lse.squeeze(-1).to(_acc(q)),
            0.0, diagonal, scale=scale,
        )  # fmt: skip
        acc = _acc(q)
        return dq.to(acc), _unrepeat(dk.to(acc), kv_heads), _unrepeat(dv.to(acc), kv_heads)
    qf, kf, vf = q.to(_acc(q)), k.to(_acc(q)), v.to(_acc(q))
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if diagonal:
        scores.masked_fill_(_above_diagonal(scores), -torch.inf)
    probs = scores.sub_(lse).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), grad)
    delta = (grad * out).sum(-1, keepdim=True)
    dscores = probs.mul_(torch.matmul(grad, vf.transpose(-1, -2)).sub_(delta)).mul_(scale)
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-1, -2), qf)
    return dq, _unrepeat(dk, kv_heads), _unrepeat(dv, kv_heads)


def _pairs(rank: int, source: int, world: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The (query block, key block, diagonal) pairs this rank computes when
    it holds ``source``'s key/value blocks: zig-zag, rank ``r`` holds blocks
    ``r`` and ``2 * world - 1 - r``; causally, a key block after the query
    block is skipped."""
    q_ids = [rank, 2 * world - 1 - rank]
    k_ids = [source, 2 * world - 1 - source]
    return [
        (i, j, causal and k_ids[j] == q_ids[i])
        for i in range(2)
        for j in range(2)
        if not (causal and k_ids[j] > q_ids[i])
    ]


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward, by hand: what autograd keeps
    is this rank's queries, keys, values, output and log-sum-exp, all of
    its own share of the sequence. Backward passes the key/value blocks
    round the ring once more, with their gradients travelling beside them
    and arriving home after the last step."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        links: _Links, scale: float, causal: bool,
    ) -> torch.Tensor:  # fmt: skip
        group = links.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        heads = k.shape[1]
        q_blocks = q.chunk(2, dim=2)
        out: list[torch.Tensor | None] = [None, None]
        lse: list[torch.Tensor | None] = [None, None]
        kv = torch.cat([k, v], dim=1)  # one tensor travels the ring
        for step in range(world):
            requests: list[Any] = []
            if step < world - 1:  # the next block is on its way meanwhile
                coming, requests = links.exchange(kv, tag=0)
            k_blocks, v_blocks = kv[:, :heads].chunk(2, dim=2), kv[:, heads:].chunk(2, dim=2)
            for i, j, diagonal in _pairs(rank, (rank - step) % world, world, causal):
                o_b, l_b = _block_forward(q_blocks[i], k_blocks[j], v_blocks[j], scale, diagonal)
                o_a, l_a = out[i], lse[i]
                if o_a is None or l_a is None:
                    out[i], lse[i] = o_b, l_b
                    continue
                merged = torch.logaddexp(l_a, l_b)
                out[i] = o_a.mul_(torch.exp(l_a - merged)).add_(o_b * torch.exp(l_b - merged))
                lse[i] = merged
            if requests:
                links.wait(requests)
                kv = coming
        assert all(o is not None for o in out)  # every query block sees its own block
        whole_out = torch.cat(out, dim=2)  # type: ignore[arg-type]
        whole_lse = torch.cat(lse, dim=2)  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, whole_out, whole_lse)
        ctx.links, ctx.scale, ctx.causal = links, scale, causal
        return whole_out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        links, scale, causal = ctx.links, ctx.scale, ctx.causal
        world, rank = dist.get_world_size(links.group), dist.get_rank(links.group)
        heads = k.shape[1]
        grad = grad.to(_acc(q))
        q_blocks, g_blocks = q.chunk(2, dim=2), grad.chunk(2, dim=2)
        o_blocks, l_blocks = out.chunk(2, dim=2), lse.chunk(2, dim=2)
        dq = [torch.zeros_like(b, dtype=_acc(q)) for b in q_blocks]
        kv = torch.cat([k, v], dim=1)
        dkv_requests: list[Any] = []
        dkv_coming: torch.Tensor | None = None
        for step in range(world):
            kv_requests: list[Any] = []
            if step < world - 1:
                kv_coming, kv_requests = links.exchange(kv, tag=0)
            k_blocks, v_blocks = kv[:, :heads].chunk(2, dim=2), kv[:, heads:].chunk(2, dim=2)
            dkv = torch.zeros(kv.shape, dtype=_acc(q), device=kv.device)
            dk_blocks, dv_blocks = dkv[:, :heads].chunk(2, dim=2), dkv[:, heads:].chunk(2, dim=2)
            for i, j, diagonal in _pairs(rank, (rank - step) % world, world, causal):
                dq_b, dk_b, dv_b = _block_backward(
                    g_blocks[i], q_blocks[i], k_blocks[j], v_blocks[j],
                    o_blocks[i], l_blocks[i], scale, diagonal,
                )  # fmt: skip
                dq[i].add_(dq_b)
                dk_blocks[j].add_(dk_b)
                dv_blocks[j].add_(dv_b)
            # The earlier ranks' gradients for this block, sent while it was
            # computed here; the sum goes on to the next rank.
            if dkv_requests:
                links.wait(dkv_requests)
                assert dkv_coming is not None
                dkv.add_(dkv_coming)
            if world > 1:
                dkv_coming, dkv_requests = links.exchange(dkv, tag=1)
            else:
                dkv_coming = dkv
            if kv_requests:
                links.wait(kv_requests)
                kv = kv_coming
        links.wait(dkv_requests)  # the last step's sums: this rank's own block
        assert dkv_coming is not None
        dk, dv = dkv_coming[:, :heads], dkv_coming[:, heads:]
        return torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    group = group_for_attention(module, "ring attention", "ring_model")
    world = dist.get_world_size(group)
    total = query.shape[2] * world
    refuse_unsupported(
        "ring attention", type(module).__name__, total, dropout, sliding_window, softcap
    )
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else is_causal
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    links = _LINKS[module]  # made with the group (prepare_links)
    out: torch.Tensor = _RingAttention.apply(query, key, value, links, scale, causal)  # type: ignore[no-untyped-call, unused-ignore]
    return out.transpose(1, 2).contiguous(), None


def ring_model(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, grad_scale: float = 1.0
) -> nn.Module:
    """Ring attention over ``group`` (default: the world) for ``model`` in
    place (see the module docstring); after tensor parallelism, if any.
    Returns the model. ``grad_scale`` as for
    :func:`~pc_tensor.ulysses_model`."""
    prepare(model, group, grad_scale, (RING_ATTENTION, ring_attention), True, "ring attention")
    return prepare_links(model)


def prepare_links(model: nn.Module) -> nn.Module:
    """The ring's links for ``model``'s sequence-parallel group, made now
    (a collective over the group) and shared by its modules."""
    links = _Links(prepared_group(model))
    for module in model.modules():
        _LINKS[module] = links
    return model
