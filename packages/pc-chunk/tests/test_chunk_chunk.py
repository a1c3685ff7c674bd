"""Chunk gather / release / reduce-scatter against plain torch, at world
sizes 2 and 4, fp32 and bf16; and the state machine's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_chunk import Chunk, ChunkState, ChunkStateError
from pc_comm import TorchCommunicator
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(180)

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]


def _params(dtype: torch.dtype, seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def check_chunk(dtype: torch.dtype) -> None:
    comm = TorchCommunicator()
    rank, world = comm.rank, comm.world_size
    params = _params(dtype, seed=0)  # the same weights on every rank
    originals = [p.detach().clone() for p in params]
    chunk = Chunk(36, dtype, comm=comm, name="c")
    for p in params:
        chunk.append(p)
    assert chunk.used == 15 + 7 + 8 + 1
    chunk.close(release=True)
    assert chunk.state is ChunkState.FREE
    assert all(p.numel() == 0 for p in params)  # released: parameters are empty
    assert chunk.shard is not None
    assert chunk.shard.numel() == 36 // world

    chunk.access()  # gathers
    for p, original in zip(params, originals, strict=True):
        assert torch.equal(p.detach(), original)
        assert p.data_ptr() >= chunk.payload.data_ptr()  # type: ignore[union-attr]
    with pytest.raises(ChunkStateError, match="an operator is using it"):
        chunk.release()
    # Gradients differ by rank; the reduce-scatter averages them in fp32.
    grads = [
        [
            torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i)).to(dtype)
            for i, s in enumerate(SHAPES)
        ]
        for r in range(world)
    ]
    for p, g in zip(params, grads[rank], strict=True):
        p.grad = g.clone()
    chunk.done("backward")
    with pytest.raises(ChunkStateError, match="not reduced yet"):
        chunk.release()
    shard = chunk.reduce_scatter_grads()
    assert shard is not None
    assert all(p.grad is None for p in params)
    flat = torch.zeros(world, 36)
    for r in range(world):
        flat[r, : chunk.used] = torch.cat([g.float().reshape(-1) for g in grads[r]])
    expected = flat.mean(0)[rank * chunk.shard_size : (rank + 1) * chunk.shard_size]
    assert shard.dtype == torch.float32
    torch.testing.assert_close(shard, expected, rtol=1e-5, atol=1e-6)

    # Update this rank's shard, release, gather: everyone sees every update.
    chunk.set_shard(torch.full((chunk.shard_size,), float(rank), dtype=dtype))
    chunk.release()
    chunk.gather()
    assert chunk.payload is not None
    want = torch.arange(world, dtype=dtype).repeat_interleave(chunk.shard_size)
    assert torch.equal(chunk.payload, want)
    assert torch.equal(params[0].detach().reshape(-1), want[:15])


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_release_reduce_scatter_match_torch(world_size: int) -> None:
    run_subtests(check_chunk, world_size, {"dtype": [torch.float32, torch.bfloat16]}, timeout=150)


def test_misuse_is_refused() -> None:
    chunk = Chunk(8, torch.float32)
    with pytest.raises(ValueError, match=r"holds torch\.float32; the parameter is torch\.float64"):
        chunk.append(nn.Parameter(torch.ones(2, dtype=torch.float64)))  # would be rounded
    with pytest.raises(ValueError, match=r"holds torch\.bfloat16; the parameter is torch\.float16"):
        Chunk(8, torch.bfloat16).append(nn.Parameter(torch.ones(2, dtype=torch.float16)))
    with pytest.raises(ValueError, match="an exposed shard is an fp32 master"):
        Chunk(8, torch.bfloat16, shard_dtype=torch.bfloat16, expose_shard=True)
    with pytest.raises(ValueError, match="has 8 free elements; the parameter needs 9"):
        chunk.append(nn.Parameter(torch.ones(9)))
    with pytest.raises(ChunkStateError, match=r"gather\(\) before close"):
        chunk.gather()
    with pytest.raises(ValueError, match="multiple of the world size"):
        Chunk(0, torch.float32)


def test_exposed_shards_are_fp32_masters_of_a_bf16_built_parameter() -> None:
    """[Note: exposed shards]: a bf16 (or fp16) parameter is upcast exactly
    into the fp32 master shard; the payload is in the compute dtype, and the
    exposed gradient matches the master's dtype."""
    built = [p.detach().clone() for p in _params(torch.bfloat16, seed=0)]
    half = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(1)).half())
    params = [nn.Parameter(b.clone()) for b in built] + [half]
    expected = [b.float() for b in built] + [half.detach().float()]
    chunk = Chunk(40, torch.bfloat16, expose_shard=True, name="c")
    assert chunk.shard_dtype == torch.float32
    for p in params:
        chunk.append(p)
    chunk.close(release=True)
    assert chunk.shard is not None
    assert chunk.shard.dtype == torch.float32
    for p, want in zip(params, expected, strict=True):  # released: each views its master
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), want.reshape(-1))
    chunk.access()
    assert chunk.payload is not None
    assert chunk.payload.dtype == torch.bfloat16
    for p in params:
        p.grad = torch.ones_like(p)
    chunk.done("backward")
    chunk.reduce_scatter_grads()
    chunk.release()
    for p in params:
        assert p.grad is not None
        assert p.grad.dtype == p.dtype == torch.float32
