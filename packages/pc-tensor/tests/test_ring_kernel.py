"""Ring attention's hand-written forward and backward
(pc_tensor.ring._RingAttention) against whole-sequence attention on one
rank: outputs and the gradients of queries, keys and values, over pc-comm's
shared memory and over torch.distributed, in float64
(to rounding) and float32, causal (zig-zag) and not, with grouped-query
attention, through torch's fused CPU kernel and through the matrix-product
blocks used elsewhere, at ring sizes 2 and 4."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pc_comm.testing import run_subtests
from pc_tensor import ring

pytestmark = pytest.mark.timeout(200)


def _zigzag(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    blocks = x.chunk(2 * world, dim=2)
    return torch.cat([blocks[rank], blocks[2 * world - 1 - rank]], dim=2)


def check_ring_kernel(dtype: torch.dtype, causal: bool, fused: bool, links: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 8 * world, 8
    q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64)
    # The reference: whole-sequence attention in float64 on every rank.
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=0.3, enable_gqa=True)
    ref.backward(grad)  # type: ignore[no-untyped-call]
    assert qr.grad is not None
    assert kr.grad is not None
    assert vr.grad is not None

    original = ring._fused
    ring._fused = original if fused else (lambda q: False)
    try:
        mine = [_zigzag(t, rank, world).to(dtype).requires_grad_() for t in (q, k, v)]
        world_group = dist.group.WORLD
        assert world_group is not None
        ring_links = ring._Links(world_group)
        if links == "torch":
            ring_links.shm = None  # torch.distributed's sends instead of shared memory
        out = ring._RingAttention.apply(  # type: ignore[no-untyped-call]
            *mine, ring_links, 0.3, causal
        )
        out.backward(_zigzag(grad, rank, world).to(dtype))
    finally:
        ring._fused = original
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    expected = [ref, qr.grad, kr.grad, vr.grad]
    got = [out, *(t.grad for t in mine)]
    for name, e, g in zip(["out", "dq", "dk", "dv"], expected, got, strict=True):
        assert g is not None, name
        assert g.dtype == dtype, name
        torch.testing.assert_close(
            g.double(), _zigzag(e.detach(), rank, world), rtol=tol, atol=tol, msg=name
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_kernel_matches_whole_attention(world_size: int) -> None:
    cases: dict[str, list[Any]] = {
        "dtype": [torch.float64, torch.float32],
        "causal": [True, False],
        "fused": [True, False],
        "links": ["shm", "torch"],
    }
    run_subtests(check_ring_kernel, world_size, cases, timeout=180)
