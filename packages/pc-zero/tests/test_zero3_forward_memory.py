"""Issue 56: at the end of forward, ZeRO-3 over chunks holds its shards and
at most one gathered chunk, not the whole gathered model ([Note: one
payload storage] in pc_chunk.chunk). What autograd saved for backward is
counted from outside (every storage reachable from the loss's graph) with
the chunks' own payloads; before, each linear layer's saved ``weight.t()``
kept its released payload alive, so the whole fp32 model was live until
backward. Training stays equal to single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pc_chunk import ChunkState
from pc_comm.testing import run_subtests, saved_storage_bytes
from pc_zero import GeminiDDP

pytestmark = pytest.mark.timeout(300)

LAYERS, WIDTH, STEPS = 8, 256, 3


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _reference_step(
    reference: nn.Module, optimizer: torch.optim.Optimizer, step: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One single-process step on the global batch: the batch and its loss."""
    x = torch.randn(2 * world, WIDTH, generator=torch.Generator().manual_seed(step))
    loss = reference(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return x, loss


def _step_and_compare(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, ref_loss: torch.Tensor, world: int
) -> None:
    """This rank's step; the mean loss over the ranks is the reference's."""
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)


def check_forward_holds_one_chunk(checkpointing: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _mlp()
    layer = WIDTH * WIDTH + WIDTH
    quantum = 64 * world
    model = GeminiDDP(_mlp(), chunk_size=-(-layer // quantum) * quantum)  # a layer a chunk
    chunks = model.manager.chunks
    assert len(chunks) == LAYERS
    chunk_bytes = max(c.payload_bytes for c in chunks)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, ref_loss = _reference_step(reference, ref_opt, step, world)
        mine = x[rank * 2 : rank * 2 + 2]
        if checkpointing:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(model, mine, use_reentrant=False)
        else:
            out = model(mine)
        loss = out.square().mean()
        # Under recomputation forward saves no weights (and reading a saved
        # tensor would recompute it): the chunks' own payloads only.
        live = {} if checkpointing else saved_storage_bytes(loss)
        for chunk in chunks:  # and what the chunks hold gathered
            if chunk.payload is not None:
                storage = chunk.payload.untyped_storage()
                live[storage.data_ptr()] = storage.nbytes()
        held = sum(live.values())
        activations = 4 * LAYERS * 2 * WIDTH * 4 * 2  # inputs and outputs saved, generous
        assert held <= chunk_bytes + activations, (
            f"step {step}: {held} bytes live at the end of forward, more than one gathered "
            f"chunk ({chunk_bytes}) and the activations ({activations}); the model's payloads "
            f"are {sum(c.payload_bytes for c in chunks)} bytes"
        )
        assert sum(c.state is not ChunkState.FREE for c in chunks) <= 1
        _step_and_compare(loss, opt, ref_loss, world)
    with model.summon_full_params():
        for (name, ours), theirs in zip(
            model.module.named_parameters(), reference.parameters(), strict=True
        ):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)


def test_forward_holds_at_most_one_gathered_chunk() -> None:
    run_subtests(check_forward_holds_one_chunk, 2, {"checkpointing": [False, True]})


class _NormLast(nn.Module):
    """A block whose norm is registered after its linear layer but runs
    before it, as a Llama block's norms follow its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.norm(x)))


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_NormLast() for _ in range(LAYERS)])


def check_revisited_chunks_are_not_kept() -> None:
    """Chunks packed in registration order, each a linear layer, a norm and
    the next linear layer: the next block's norm starts the next chunk, so
    a forward runs that norm, then comes back to the chunk it released for
    the linear layer. Such a chunk is gathered again, not kept for the rest
    of the forward (only a tied weight's is): before, every chunk was, and
    the whole model stayed gathered until backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    quantum = 64 * world
    size = 2 * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH  # linear, norm, linear
    model = GeminiDDP(_blocks(), chunk_size=-(-size // quantum) * quantum)
    chunks = model.manager.chunks
    assert len(chunks) >= 4
    reference = _blocks()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, ref_loss = _reference_step(reference, ref_opt, step, world)
        loss = model(x[rank * 2 : rank * 2 + 2]).square().mean()
        gathered = [c for c in chunks if c.state is not ChunkState.FREE]
        assert len(gathered) <= 1, f"step {step}: {len(gathered)} of {len(chunks)} gathered"
        _step_and_compare(loss, opt, ref_loss, world)


def test_a_chunk_revisited_in_forward_is_gathered_again_not_kept() -> None:
    run_subtests(check_revisited_chunks_are_not_kept, 2, {})
