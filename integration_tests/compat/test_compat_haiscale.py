"""haiscale programs on pc: written from haiscale's public call shapes
(``haiscale.pipeline``: GPipe / PipeDream / Interleaved1F1B with
``forward_backward(x, criterion=, labels=)``, the loss divided by ``chunks``
by the program, ``checkpoint="except_last"``, saves through ``.module``;
``haiscale.fsdp.FullyShardedDataParallel`` with a ``functools.partial``
wrap policy, ``backward_prefetch`` and per-rank optimizer state) with only
the imports changed (``from haiscale.x import y`` -> ``from
pc_compat.haiscale.x import y``); ``haiscale.ddp.DistributedDataParallel``
with ``device_ids=``. Each trains as plain single-process training on the
whole batch (fp32, several steps); where pc refuses, the exact message.
One spawn of 2 ranks runs every sub-case."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp.wrap import (
    size_based_auto_wrap_policy as torch_size_policy,
)
from torch.distributed.fsdp.wrap import (
    transformer_auto_wrap_policy as torch_transformer_policy,
)

from pc_comm.testing import run_subtests
from pc_compat.haiscale.ddp import DistributedDataParallel
from pc_compat.haiscale.fsdp import FullyShardedDataParallel
from pc_compat.haiscale.pipeline import (
    GPipe,
    Interleaved1F1B,
    PipeDream,
    SequentialModel,
    partition,
)
from pc_zero import size_based_auto_wrap_policy
from pc_zero.fsdp import BackwardPrefetch

pytestmark = pytest.mark.timeout(120)

STEPS = 3
CHUNKS = 4
BATCH = 8
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _pipe_model() -> SequentialModel:
    torch.manual_seed(0)
    return SequentialModel(nn.Linear(6, 16), Block(16), Block(16), Block(16), nn.Linear(16, 3))


def _batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _haiscale_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What haiscale programs pass: each microbatch's loss over ``chunks``."""
    return _mse(out, y) / CHUNKS


def _reference(steps: int = STEPS) -> tuple[nn.Module, list[torch.Tensor]]:
    model = _pipe_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = _mse(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _pipeline(kind: str, **kwargs: Any) -> tuple[nn.Module, Any]:
    model = _pipe_model()
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "interleaved":
        chunks = partition(model, rank, world, num_model_chunks=2)
        assert isinstance(chunks, list)
        return model, Interleaved1F1B(chunks, CHUNKS, **kwargs)
    stage = partition(model, rank, world)
    assert isinstance(stage, nn.Module)
    wrapper = GPipe if kind == "gpipe" else PipeDream
    return model, wrapper(stage, CHUNKS, **kwargs)


def _compare_owned(pipe: Any, model: nn.Module, ref: nn.Module) -> None:
    owned = {id(p) for p in pipe.parameters()}
    compared = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if id(p) in owned:
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
            compared += 1
    assert compared > 0


# ------------------------------------------------------------------- ddp


def check_ddp_with_device_ids() -> None:
    """haiscale's DDP as its programs build it, ``device_ids=[local_rank]``
    (the one device of this process; the CPU here): each rank's half of the
    batch, the same result as one process on the whole batch."""
    ref, ref_losses = _reference()
    model = _pipe_model()
    ddp = DistributedDataParallel(model, device_ids=[dist.get_rank()])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    half = BATCH // dist.get_world_size()
    rank = dist.get_rank()
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _mse(ddp(x[rank * half : (rank + 1) * half]), y[rank * half : (rank + 1) * half])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(
            mean / dist.get_world_size(), ref_losses[step], rtol=RTOL, atol=ATOL
        )
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="one process drives one device"):
        DistributedDataParallel(_pipe_model(), device_ids=[0, 1])


# ------------------------------------------------------------- pipelines


def check_haiscale_loop_matches_single_process(kind: str, checkpoint: str) -> None:
    """The haiscale loop: the criterion divides by chunks, forward_backward
    SUMS the microbatch gradients, the losses' sum is the batch loss."""
    ref, ref_losses = _reference()
    model, pipe = _pipeline(kind, checkpoint=checkpoint)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        loss, _ = pipe.forward_backward(x, criterion=_haiscale_loss, labels=(y,))
        opt.step()
        opt.zero_grad()
        if pipe.is_last_stage:
            torch.testing.assert_close(loss.sum(), ref_losses[step], rtol=RTOL, atol=ATOL)
        else:
            assert loss is None
    _compare_owned(pipe, model, ref)


def check_scale_grads(scale_grads: bool) -> None:
    """With a mean criterion: scale_grads=True gives the batch mean's
    gradient (single-process), False ``chunks`` times it (haiscale's sum)."""
    ref = _pipe_model()
    x, y = _batch(0)
    _mse(ref(x), y).backward()  # type: ignore[no-untyped-call]
    model, pipe = _pipeline("pipedream", scale_grads=scale_grads)
    pipe.forward_backward(x, criterion=_mse, labels=(y,))
    factor = 1.0 if scale_grads else float(CHUNKS)
    owned = {id(p) for p in pipe.parameters()}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if id(p) in owned:
            assert q.grad is not None
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad * factor, rtol=RTOL, atol=ATOL)


class _Counter(nn.Module):
    """Counts its forwards: recomputation under checkpointing runs it again
    (first in its stage, since torch stops recomputing once it has what
    backward needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def check_checkpoint_modes(checkpoint: Any, recomputed: int) -> None:
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = _Counter()
    model = SequentialModel(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    stage = partition(model, rank, world, balance=[2, 1])
    assert isinstance(stage, nn.Module)
    stage = SequentialModel(counter, *stage) if rank == 0 else stage
    pipe = GPipe(stage, CHUNKS, checkpoint=checkpoint)
    x, y = _batch(0)
    pipe.forward_backward(x, criterion=_haiscale_loss, labels=(y,))  # shapes found here
    counter.calls = 0
    pipe.forward_backward(x, criterion=_haiscale_loss, labels=(y,))
    if rank == 0:
        assert counter.calls == CHUNKS + recomputed, (checkpoint, counter.calls)


def check_unknown_checkpoint_is_refused() -> None:
    stage = partition(_pipe_model(), dist.get_rank(), dist.get_world_size())
    assert isinstance(stage, nn.Module)
    expected = (
        "checkpoint must be one of 'always', 'except_last', 'never' (or True / False), "
        "got 'sometimes'."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        GPipe(stage, CHUNKS, checkpoint="sometimes")
    with pytest.raises(TypeError, match=re.escape("scale_grads must be True or False, got 1.")):
        GPipe(stage, CHUNKS, scale_grads=1)  # type: ignore[arg-type]


def check_save_through_module(kind: str, root: str) -> None:
    """haiscale programs save ``model.module.state_dict()`` per rank and load
    it back the same way."""
    ref, _ = _reference()
    model, pipe = _pipeline(kind)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        pipe.forward_backward(x, criterion=_haiscale_loss, labels=(y,))
        opt.step()
        opt.zero_grad()
    rank = dist.get_rank()
    path = Path(root) / f"{kind}.RANK{rank:03d}.pt"
    state = pipe.module.state_dict()
    own = dict(pipe.module.named_parameters())
    assert set(own) <= set(state)
    assert not any(k.startswith("stages.") for k in state)
    torch.save({"model": state, "optimizer": opt.state_dict()}, path)
    _, fresh = _pipeline(kind)
    saved = torch.load(path)
    fresh.module.load_state_dict(saved["model"])
    _compare_owned(pipe, model, ref)  # the trained stage is single-process training
    for a, b in zip(fresh.parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ FSDP


def _fsdp_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3))


def _fsdp_reference(steps: int) -> tuple[nn.Module, list[torch.Tensor]]:
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = _mse(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _fsdp_train(model: FullyShardedDataParallel, opt: Any, steps: range) -> list[torch.Tensor]:
    rank = dist.get_rank()
    mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = _mse(model(x[mine]), y[mine])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total / dist.get_world_size())
    return losses


POLICIES: dict[str, tuple[Any, int]] = {
    "torch_size": (functools.partial(torch_size_policy, min_num_params=200), 3),
    "torch_blocks": (functools.partial(torch_transformer_policy, transformer_layer_cls={Block}), 3),
    "pc_size": (functools.partial(size_based_auto_wrap_policy, min_num_params=200), 3),
    "none": (None, 1),
}
PREFETCH: dict[str, Any] = {
    "pre": BackwardPrefetch.BACKWARD_PRE,
    "post": BackwardPrefetch.BACKWARD_POST,
    "torch_pre": TorchBackwardPrefetch.BACKWARD_PRE,
    "off": None,
}


def _count_prefetches(model: FullyShardedDataParallel) -> dict[str, int]:
    """Asynchronous all-gathers (prefetches) per pass, seen on each chunk."""
    counts = {"forward": 0, "backward": 0}
    for chunk in model.chunks:
        gather = chunk.gather

        def counted(*args: Any, _gather: Any = gather, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):
                in_backward = torch._C._current_graph_task_id() != -1
                counts["backward" if in_backward else "forward"] += 1
            return _gather(*args, **kwargs)

        chunk.gather = counted  # type: ignore[method-assign]
    return counts


def check_fsdp_matches_single_process(policy: str, prefetch: str) -> None:
    wrap, units = POLICIES[policy]
    ref, ref_losses = _fsdp_reference(STEPS)
    model = FullyShardedDataParallel(
        _fsdp_model(), auto_wrap_policy=wrap, backward_prefetch=PREFETCH[prefetch]
    )
    assert len(model.units) == units, [type(u).__name__ for u in model.units]
    if policy == "torch_blocks":
        assert [type(u) for u in model.units[:-1]] == [Block, Block]
    counts = _count_prefetches(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = _fsdp_train(model, opt, range(STEPS))
    for got, want in zip(losses, ref_losses, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    full = model.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=name)
    if units > 1:  # the recorded order drives prefetches from the second step
        assert counts["forward"] > 0
        assert (counts["backward"] > 0) == (PREFETCH[prefetch] is not None), counts


def check_fsdp_forward_prefetch_flag() -> None:
    model = FullyShardedDataParallel(
        _fsdp_model(),
        auto_wrap_policy=POLICIES["torch_blocks"][0],
        forward_prefetch=False,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    counts = _count_prefetches(model)
    _fsdp_train(model, torch.optim.SGD(model.parameters(), lr=0.1), range(STEPS))
    assert counts["forward"] == 0, counts
    assert counts["backward"] > 0, counts


def check_fsdp_torch_policy_stops_recursion() -> None:
    """A torch-style policy answering recurse=False for Blocks keeps
    everything inside them out of the units, as torch does."""

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return not isinstance(module, Block)
        return isinstance(module, nn.Linear)

    model = FullyShardedDataParallel(_fsdp_model(), auto_wrap_policy=policy)
    assert [type(u) for u in model.units] == [nn.Linear, nn.Linear, nn.Sequential]


def check_fsdp_refusals() -> None:
    expected = (
        "backward_prefetch must be BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch."
        "BACKWARD_POST or None, got 'pre'."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        FullyShardedDataParallel(_fsdp_model(), backward_prefetch="pre")  # type: ignore[arg-type]
    expected = (
        "auto_wrap_policy got the factory itself; call it, e.g. "
        "size_based_auto_wrap_policy(min_num_params=1_000_000), or pass "
        "functools.partial(size_based_auto_wrap_policy, min_num_params=1_000_000)."
    )
    with pytest.raises(TypeError, match=re.escape(expected)):
        FullyShardedDataParallel(_fsdp_model(), auto_wrap_policy=size_based_auto_wrap_policy)
    with pytest.raises(TypeError, match=re.escape("auto_wrap_policy must be a ModuleSizePolicy")):
        FullyShardedDataParallel(_fsdp_model(), auto_wrap_policy=5)  # type: ignore[arg-type]


def check_fsdp_per_rank_optimizer_resume(root: str) -> None:
    """Each rank saves and reloads its own optimizer.state_dict(); the ranks'
    shards differ in size, and the resumed run equals the uninterrupted one.
    Loading another rank's file is refused with a clear error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrap = POLICIES["torch_size"][0]
    ref, ref_losses = _fsdp_reference(2 * STEPS)

    def build() -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
        model = FullyShardedDataParallel(_fsdp_model(), auto_wrap_policy=wrap)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)

    model, opt = build()
    sizes = torch.tensor([p.numel() for p in model.parameters()])
    others = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(others, sizes)
    assert not torch.equal(others[0], others[1])  # the shards differ between ranks
    first = _fsdp_train(model, opt, range(STEPS))
    path = Path(root) / f"fsdp.RANK{rank:03d}.pt"
    torch.save({"model": model.full_state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    model, opt = build()
    saved = torch.load(path)
    model.load_full_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    second = _fsdp_train(model, opt, range(STEPS, 2 * STEPS))
    for got, want in zip(first + second, ref_losses, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    full = model.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=name)

    model, opt = build()
    other = torch.load(Path(root) / f"fsdp.RANK{1 - rank:03d}.pt")
    model.load_full_state_dict(other["model"])
    opt.load_state_dict(other["optimizer"])
    x, y = _batch(0)
    _mse(model(x), y).backward()  # type: ignore[no-untyped-call]
    pattern = (
        r"optimizer state 'exp_avg' of parameter '[\w.]+' has shape \(\d+,\), but this rank's "
        r"shard of the parameter has shape \(\d+,\): the optimizer state was saved for another "
        r"shard \(another rank's file, another world size or another auto_wrap_policy\)\. "
        r"A sharded model's optimizer state is per rank: each rank loads the state_dict\(\) it "
        r"saved itself, at the same world size and wrapping\."
    )
    with pytest.raises(ValueError, match=pattern):
        opt.step()


# ------------------------------------------------------------------ cases


def _cases() -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for kind in ("gpipe", "pipedream", "interleaved"):
        for mode in ("except_last", "never"):
            cases[f"loop-{kind}-{mode}"] = functools.partial(
                check_haiscale_loop_matches_single_process, kind, mode
            )
        cases[f"save-{kind}"] = functools.partial(check_save_through_module, kind)
    cases["loop-gpipe-always"] = functools.partial(
        check_haiscale_loop_matches_single_process, "gpipe", "always"
    )
    for scale in (True, False):
        cases[f"scale_grads-{scale}"] = functools.partial(check_scale_grads, scale)
    modes: list[tuple[Any, int]] = [
        ("always", CHUNKS),
        ("except_last", CHUNKS - 1),
        ("never", 0),
        (True, CHUNKS),
        (False, 0),
    ]
    for mode, recomputed in modes:
        cases[f"checkpoint-{mode}"] = functools.partial(check_checkpoint_modes, mode, recomputed)
    cases["checkpoint-refused"] = check_unknown_checkpoint_is_refused
    for policy in POLICIES:
        cases[f"fsdp-{policy}-pre"] = functools.partial(
            check_fsdp_matches_single_process, policy, "pre"
        )
    for prefetch in ("post", "torch_pre", "off"):
        cases[f"fsdp-torch_blocks-{prefetch}"] = functools.partial(
            check_fsdp_matches_single_process, "torch_blocks", prefetch
        )
    cases["fsdp-forward_prefetch"] = check_fsdp_forward_prefetch_flag
    cases["fsdp-recurse"] = check_fsdp_torch_policy_stops_recursion
    cases["fsdp-refused"] = check_fsdp_refusals
    cases["fsdp-optimizer-resume"] = check_fsdp_per_rank_optimizer_resume
    cases["ddp-device_ids"] = check_ddp_with_device_ids
    return cases


CASES = _cases()
NEEDS_ROOT = {"save-gpipe", "save-pipedream", "save-interleaved", "fsdp-optimizer-resume"}


def run_case(root: str, case: str) -> None:
    if case in NEEDS_ROOT:
        CASES[case](root)
    else:
        CASES[case]()


def test_haiscale_programs_run_on_pc(tmp_path: Path) -> None:
    run_subtests(run_case, 2, {"case": list(CASES)}, args=(str(tmp_path),), timeout=110)
