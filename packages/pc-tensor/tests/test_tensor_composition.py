"""Tensor parallelism composed with the other dimensions, against plain
single-process training on the global batch: ZeRO-1/2 over the data-
parallel ranks of a dp 2 x tp 2 mesh (with gradient clipping, whose norm
spans the tensor-parallel shards), and a 1F1B pipeline over a pp 2 x tp 2
mesh; with and without sequence parallelism."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tp_models import batch, build

from pc_comm import make_subgroups
from pc_comm.testing import run_subtests
from pc_pipeline import PipeDream
from pc_tensor import full_state_dict, shard_model, vocab_parallel_cross_entropy
from pc_zero import LowLevelZeroOptimizer

pytestmark = pytest.mark.timeout(300)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _adamw(params: object) -> torch.optim.AdamW:
    # lr 1e-4: Adam divides by the gradient's RMS (plus eps), so an entry
    # whose gradient is near zero turns a last-bit difference from another
    # reduction order into a step of up to lr * |g| / eps; 1e-4 keeps that
    # inside the fp32 tolerance.
    return torch.optim.AdamW(params, lr=1e-4, eps=1e-6, weight_decay=0.01)  # type: ignore[arg-type]


def check_zero_with_tensor_parallel(
    name: str, stage: int, clip: float, sequence_parallel: bool
) -> None:
    groups = make_subgroups(tp_size=2)  # dp 2 x tp 2
    dp_rank, dp = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
    ref = build(name)
    vocab = ref.config.vocab_size
    model = shard_model(copy.deepcopy(ref), groups.tp, sequence_parallel=sequence_parallel)
    opt = LowLevelZeroOptimizer(
        _adamw(model.parameters()),
        stage=stage,
        dp_process_group=groups.dp,
        max_norm=clip,
        tp_process_group=groups.tp,
    )
    ref_opt = _adamw(ref.parameters())
    for step in range(3):
        full = batch(name, step, vocab, size=2 * dp)
        mine = {k: v[2 * dp_rank : 2 * dp_rank + 2] for k, v in full.items()}
        loss = model(**mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**full).loss
        ref_loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert norm > clip  # the clipping is exercised
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.dp)
        _close(mean / dp, ref_loss.detach(), f"step {step} loss")
        state = full_state_dict(model)
        for key, value in ref.state_dict().items():
            _close(state[key], value, f"step {step} {key}")


class _Embed(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.wte, self.wpe = lm.transformer.wte, lm.transformer.wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.wte(ids) + self.wpe(positions)
        return out


class _Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


class _Head(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.ln_f, self.lm_head = lm.transformer.ln_f, lm.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return out


def _stages(lm: Any) -> list[nn.Module]:
    blocks = lm.transformer.h
    return [
        nn.Sequential(_Embed(lm), _Block(blocks[0])),
        nn.Sequential(_Block(blocks[1]), _Head(lm)),
    ]


def _next_token(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)


def check_pipeline_with_tensor_parallel(sequence_parallel: bool) -> None:
    groups = make_subgroups(pp_size=2, tp_size=2)
    pp_rank = dist.get_rank(groups.pp)
    ref_lm = build("gpt2", tie_word_embeddings=False)  # ties across stages are not supported
    lm = shard_model(copy.deepcopy(ref_lm), groups.tp, sequence_parallel=sequence_parallel)
    ref = nn.Sequential(*_stages(ref_lm))
    stage = _stages(lm)[pp_rank]
    pipe = PipeDream(stage, chunks=2, process_group=groups.pp, scale_grads=True)
    opt, ref_opt = _adamw(stage.parameters()), _adamw(ref.parameters())

    def criterion(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(*_next_token(logits, ids), groups.tp)

    vocab = ref_lm.config.vocab_size
    for step in range(3):
        ids = batch("gpt2", step, vocab, size=4)["input_ids"]
        losses, _ = pipe.forward_backward(ids, criterion=criterion, labels=(ids,))
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(*_next_token(ref(ids), ids))
        ref_loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
        ref_opt.step()
        ref_opt.zero_grad()
        if pp_rank == 1:
            assert losses is not None
            _close(losses.mean(), ref_loss.detach(), f"step {step} loss")
        state, ref_state = full_state_dict(lm), ref_lm.state_dict()
        mine = ("transformer.wte", "transformer.wpe", "transformer.h.0.")
        if pp_rank == 1:
            mine = ("transformer.h.1.", "transformer.ln_f", "lm_head")
        keys = [k for k in ref_state if k.startswith(mine)]
        assert len(keys) > 5
        for key in keys:
            _close(state[key], ref_state[key], f"step {step} {key}")


def check_all(case: str, sequence_parallel: bool) -> None:
    if case == "pipeline":
        check_pipeline_with_tensor_parallel(sequence_parallel)
        return
    name, stage, clip = case.split("-")
    check_zero_with_tensor_parallel(name, int(stage[-1]), float(clip), sequence_parallel)


def test_tensor_parallel_composes() -> None:
    run_subtests(
        check_all,
        4,
        {
            "case": ["gpt2-zero1-0", "gpt2-zero1-0.05", "llama-zero2-0.05", "pipeline"],
            "sequence_parallel": [False, True],
        },
        timeout=280,
    )
