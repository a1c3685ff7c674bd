"""Tensor-parallel layers against their unsharded originals: forward,
backward (input and sharded weight gradients) and an optimizer step, at
tp 2 and 4, for Linear and GPT-2's Conv1D, the vocabulary-parallel
embedding and the cross-entropy that never gathers the logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers.pytorch_utils import Conv1D

from pc_comm.testing import run_subtests
from pc_tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sync_replicated_grads,
    vocab_parallel_cross_entropy,
)

pytestmark = pytest.mark.timeout(240)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def _rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    return t.chunk(world, dim=dim)[rank]


def check_mlp_matches_unsharded(kind: str) -> None:
    group = dist.group.WORLD
    assert group is not None
    torch.manual_seed(0)
    if kind == "linear":
        up, down = nn.Linear(8, 16), nn.Linear(16, 8)
    else:
        up, down = Conv1D(16, 8), Conv1D(8, 16)  # Conv1D(out, in): weight [in, out]
    ref = nn.Sequential(copy.deepcopy(up), nn.GELU(), copy.deepcopy(down))
    make_col = (
        ColumnParallelLinear.from_linear if kind == "linear" else ColumnParallelLinear.from_conv1d
    )
    make_row = RowParallelLinear.from_linear if kind == "linear" else RowParallelLinear.from_conv1d
    tp = nn.Sequential(make_col(up, group), nn.GELU(), make_row(down, group))  # type: ignore[arg-type, unused-ignore]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tp_opt = torch.optim.SGD(tp.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(step))
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_tp = ref(x_ref), tp(x_tp)
        _close(y_tp, y_ref)
        y_ref.square().mean().backward()
        y_tp.square().mean().backward()
        assert x_tp.grad is not None
        assert x_ref.grad is not None
        _close(x_tp.grad, x_ref.grad)
        ref_opt.step()
        tp_opt.step()
        ref_opt.zero_grad()
        tp_opt.zero_grad()
    col, row = tp[0], tp[2]
    assert isinstance(col, ColumnParallelLinear)
    assert isinstance(row, RowParallelLinear)
    w_up: torch.Tensor = ref[0].weight  # type: ignore[assignment]
    w_down: torch.Tensor = ref[2].weight  # type: ignore[assignment]
    if kind == "conv1d":
        w_up, w_down = w_up.t(), w_down.t()
    _close(col.weight, _rows(w_up))
    _close(row.weight, _rows(w_down, dim=1))
    assert row.bias is not None
    ref_bias: torch.Tensor = ref[2].bias  # type: ignore[assignment]
    _close(row.bias, ref_bias)
    # Parameter bytes per rank: 1/tp of the sharded weights (row bias whole).
    sharded = col.weight.numel() + row.weight.numel()
    assert sharded * dist.get_world_size() == w_up.numel() + w_down.numel()


def check_gathered_column_output() -> None:
    group = dist.group.WORLD
    assert group is not None
    torch.manual_seed(1)
    layer = nn.Linear(6, 8)
    col = ColumnParallelLinear.from_linear(layer, group, gather_output=True)
    x = torch.randn(3, 6)
    _close(col(x), layer(x))


def check_embedding_and_loss_match_unsharded(ignore: bool) -> None:
    group = dist.group.WORLD
    assert group is not None
    torch.manual_seed(2)
    vocab, width = 32, 8
    emb, head = nn.Embedding(vocab, width), nn.Linear(width, vocab, bias=False)
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(4))
    if ignore:
        target[0, :3] = -100
    ref_emb, ref_head = copy.deepcopy(emb), copy.deepcopy(head)
    ref_loss = nn.functional.cross_entropy(
        ref_head(torch.tanh(ref_emb(ids))).reshape(-1, vocab), target.reshape(-1)
    )
    ref_loss.backward()  # type: ignore[no-untyped-call]
    tp_emb = VocabParallelEmbedding.from_embedding(emb, group)
    tp_head = ColumnParallelLinear.from_linear(head, group)  # logits stay sharded
    logits = tp_head(torch.tanh(tp_emb(ids)))
    assert logits.shape[-1] == vocab // dist.get_world_size()
    loss = vocab_parallel_cross_entropy(logits, target, group)
    _close(loss, ref_loss)
    loss.backward()  # type: ignore[no-untyped-call]
    assert tp_emb.weight.grad is not None
    assert ref_emb.weight.grad is not None
    assert tp_head.weight.grad is not None
    assert ref_head.weight.grad is not None
    _close(tp_emb.weight.grad, _rows(ref_emb.weight.grad))
    _close(tp_head.weight.grad, _rows(ref_head.weight.grad))


def check_indivisible_sizes_are_rejected() -> None:
    group = dist.group.WORLD
    assert group is not None
    world = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"out_features \(7\) is not divisible by .* \({world}\)"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 7), group)
    with pytest.raises(ValueError, match=r"vocabulary size \(33\)"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(33, 4), group)


def check_sequence_parallel_block_matches_unsharded() -> None:
    """LayerNorm -> column -> GELU -> row + residual, with activations split
    along the sequence outside the linears: each rank's output slice, the
    input gradient, the replicated LayerNorm's summed gradient and the
    sharded weights after 3 steps equal the unsharded block's."""
    group = dist.group.WORLD
    assert group is not None
    world = dist.get_world_size()
    torch.manual_seed(5)
    norm, up, down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
    ref = [copy.deepcopy(m) for m in (norm, up, down)]
    tp_norm = copy.deepcopy(norm)
    col = ColumnParallelLinear.from_linear(up, group, sequence_parallel=True)
    row = RowParallelLinear.from_linear(down, group, sequence_parallel=True)
    ref_params = [p for m in ref for p in m.parameters()]
    tp_params = [*tp_norm.parameters(), *col.parameters(), *row.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    tp_opt = torch.optim.SGD(tp_params, lr=0.1)
    seq = 4 * world
    for step in range(3):
        x = torch.randn(2, seq, 8, generator=torch.Generator().manual_seed(10 + step))
        x_ref = x.clone().requires_grad_()
        y_ref = x_ref + ref[2](nn.functional.gelu(ref[1](ref[0](x_ref))))
        (y_ref.square().sum() / y_ref.numel()).backward()
        x_local = _rows(x, dim=1).clone().requires_grad_()
        y_local = x_local + row(nn.functional.gelu(col(tp_norm(x_local))))
        _close(y_local, _rows(y_ref.detach(), dim=1))
        (y_local.square().sum() / y_ref.numel()).backward()
        assert x_local.grad is not None
        assert x_ref.grad is not None
        _close(x_local.grad, _rows(x_ref.grad, dim=1))
        sync_replicated_grads(
            [*tp_norm.parameters(), *[p for p in row.parameters() if p is row.bias]], group
        )
        for got, want in zip(tp_norm.parameters(), ref[0].parameters(), strict=True):
            assert got.grad is not None
            assert want.grad is not None
            _close(got.grad, want.grad)
        ref_opt.step()
        tp_opt.step()
        ref_opt.zero_grad()
        tp_opt.zero_grad()
    _close(col.weight, _rows(ref[1].weight))
    _close(row.weight, _rows(ref[2].weight, dim=1))
    assert row.bias is not None
    ref_bias: torch.Tensor = ref[2].bias  # type: ignore[assignment, unused-ignore]
    _close(row.bias, ref_bias)
    with pytest.raises(ValueError, match=r"gather_output and sequence_parallel"):
        ColumnParallelLinear.from_linear(up, group, gather_output=True, sequence_parallel=True)


def check_all(case: str) -> None:
    if case == "mlp-linear":
        check_mlp_matches_unsharded("linear")
    elif case == "mlp-conv1d":
        check_mlp_matches_unsharded("conv1d")
    elif case == "gather":
        check_gathered_column_output()
    elif case == "loss":
        check_embedding_and_loss_match_unsharded(False)
    elif case == "loss-ignore":
        check_embedding_and_loss_match_unsharded(True)
    elif case == "sequence-parallel":
        check_sequence_parallel_block_matches_unsharded()
    else:
        check_indivisible_sizes_are_rejected()


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_layers_match_unsharded(world_size: int) -> None:
    run_subtests(
        check_all,
        world_size,
        {
            "case": [
                "mlp-linear",
                "mlp-conv1d",
                "gather",
                "loss",
                "loss-ignore",
                "sequence-parallel",
                "errors",
            ]
        },
    )
