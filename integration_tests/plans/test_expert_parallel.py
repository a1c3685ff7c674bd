"""Expert parallelism (``pc_tensor.shard_experts``) against single-process
training, for MoE families with and without shared experts, with the
router's auxiliary loss on (``output_router_logits=True``).

At world 2 and ep 2 each rank holds half the experts and half the batch;
dense gradients are averaged over the ranks, expert gradients come back to
their rank by the combine's all-to-all [Note: expert gradients]. The
reference trains the unsplit model in one process on the whole global
batch, its loss the mean of the two halves' losses (what data parallelism
computes: the auxiliary loss is a function of a rank's own tokens, as in
DDP, Colossal-AI and DeepSpeed). 4 steps of SGD and of AdamW; losses and
every parameter (each rank's expert rows against the same rows of the
reference) at rtol 1e-5 / atol 1e-6 (AdamW in fp32: atol 1e-4, see
TOLERANCES). The dispatch's capacity factor and
the refusals are checked too. One spawn runs every case."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from families import build, family

from pc_comm.testing import run_subtests
from pc_tensor.experts import (
    expert_parameters,
    expert_shard,
    find_experts,
    is_expert_parameter,
    shard_experts,
)

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH, SEQ, VOCAB = 4, 4, 8, 131
# SGD in fp32 and AdamW in fp64 at the strict tolerance. AdamW in fp32 at
# atol 1e-4: an expert's gradient sums its tokens in another order than the
# unsplit model does (one matrix multiply over both ranks' tokens, not two
# backward passes), and Adam's normalisation turns the last-bit difference
# of a near-zero gradient element into up to 3e-5 of a 1e-2 step; in fp64
# the same run agrees to 1e-6.
CLIP = 0.5  # below every family's gradient norm here: the clip acts at every step
TOLERANCES = {"sgd": (1e-5, 1e-6), "adamw64": (1e-5, 1e-6), "adamw": (1e-5, 1e-4)}
# Shared experts: qwen2_moe (one gated shared expert), ernie4_5_moe and
# granitemoeshared; none: mixtral, olmoe, qwen3_moe.
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "ernie4_5_moe", "qwen3_moe", "granitemoeshared"]
MOE: dict[str, Any] = {"output_router_logits": True, "router_aux_loss_coef": 0.1}


def _model(name: str, dtype: torch.dtype = torch.float32, aux: bool = True) -> nn.Module:
    model = build(family(name), **(MOE if aux else {})).to(dtype)
    if dtype == torch.float64:  # torch's grouped matrix multiply has no fp64 kernel
        config: Any = model.config
        config._experts_implementation = "eager"
    return model


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    loss: torch.Tensor = out.loss
    return loss


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _reference(name: str, kind: str, dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
    model = _model(name, dtype)
    optimizer = _optimizer(kind, model.parameters())
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        halves = [_loss(model, part) for part in ids.chunk(2)]
        loss = torch.stack(halves).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def check_parity(name: str, kind: str) -> None:
    dtype = torch.float64 if kind.endswith("64") else torch.float32
    rtol, atol = TOLERANCES[kind]
    reference, want = _reference(name, kind.removesuffix("64"), dtype)
    model = _model(name, dtype)
    paths = shard_experts(model)
    assert paths
    assert paths == [p for p, _ in find_experts(model)]
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = expert_parameters(model)
    assert experts, "no expert shards"
    optimizer = _optimizer(kind.removesuffix("64"), model.parameters())
    losses = []
    for step in range(STEPS):
        ids = _batch(step).chunk(world)[rank]
        loss = _loss(model, ids)
        loss.backward()  # type: ignore[no-untyped-call]
        for param in model.parameters():
            if param.grad is None:  # an expert no token reached this step
                param.grad = torch.zeros_like(param)
            if not is_expert_parameter(param):
                dist.all_reduce(param.grad)
                param.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    assert losses == pytest.approx(want, rel=rtol, abs=atol), (losses, want)
    theirs = dict(reference.named_parameters())
    for path, module in find_experts(model):
        shard = expert_shard(module)
        assert shard is not None
        assert shard.local * world == shard.num_experts
        assert shard.transport is not None  # one host, CPU: the shared-memory all-to-all
        for leaf, param in module.named_parameters():
            rows = theirs[f"{path}.{leaf}"][shard.first : shard.first + shard.local]
            torch.testing.assert_close(param.detach(), rows.detach(), rtol=rtol, atol=atol)
    for key, param in model.named_parameters():
        if not is_expert_parameter(param):
            torch.testing.assert_close(param.detach(), theirs[key].detach(), rtol=rtol, atol=atol)


def check_capacity(name: str) -> None:
    """With a capacity factor, a rank computes at most its share of rows
    per expert, and the forward still runs; a large factor drops nothing
    (the dropless forward's output)."""
    torch.manual_seed(0)
    ids = _batch(0).chunk(dist.get_world_size())[dist.get_rank()]
    dropless, large, small = _model(name), _model(name), _model(name)
    shard_experts(dropless)
    shard_experts(large, capacity_factor=100.0)
    shard_experts(small, capacity_factor=0.25)
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (dropless, large, small))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c), "a capacity of a quarter of the rows dropped nothing"


def check_refusals() -> None:
    model = _model("mixtral")
    for _, module in find_experts(model):  # 3 experts: ep 2 does not divide them
        setattr(module, "num_experts", 3)  # noqa: B010
        for leaf, param in list(module.named_parameters()):
            setattr(module, leaf, nn.Parameter(param[:3].detach().clone()))
    with pytest.raises(ValueError, match=r"3 experts, which the expert-parallel size 2 does not"):
        shard_experts(model)
    dense = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no experts module"):
        shard_experts(dense)


def check_booster(
    name: str,
    zero: int,
    kind: str,
    precision: str = "fp32",
    edge: bool = False,
    max_norm: float = 0.0,
    tp: int = 1,
) -> None:
    """HybridParallelPlugin(ep_size=2) at world 2 (ep 2) or 4 (ep 2 x dp 2):
    the same losses and parameters as single-process training of the
    global batch (each rank's batch a 1/world share). ``edge``: through
    Colossal-AI's call shape, MoeHybridParallelPlugin(tp_size, pp_size,
    ep_size, ...) at the compatibility edge. ``max_norm``: clipping by the
    global norm (the reference clips its whole gradient). ``tp``: the
    attention split over tp ranks too (world 4: tp 2 x ep 2), the experts
    kept whole there and split over ep."""
    from pc_booster import Booster, HybridParallelPlugin
    from pc_compat.colossalai.booster import Booster as EdgeBooster
    from pc_compat.colossalai.booster.plugin import MoeHybridParallelPlugin

    rtol, atol = TOLERANCES[kind] if precision == "fp32" else (2e-2, 2e-2)
    data = dist.get_world_size() // tp  # the ranks reading different batches
    if precision == "fp16":  # fp16's 10-bit mantissa against an fp32 reference
        rtol, atol = 5e-2, 5e-2
    reference = _model(name)
    optimizer = _optimizer(kind, reference.parameters())
    want = []
    for step in range(STEPS):
        parts = [_loss_in(reference, part, precision) for part in _batch(step).chunk(data)]
        loss = torch.stack(parts).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        if max_norm:
            norm = nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            assert norm > max_norm, f"the clip at {max_norm} is not exercised (norm {norm})"
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    plugin: HybridParallelPlugin
    if edge:
        plugin = MoeHybridParallelPlugin(
            1, 1, 2, zero_stage=zero, precision=precision, max_norm=max_norm
        )
        booster: Booster = EdgeBooster(plugin=plugin)
    else:
        plugin = HybridParallelPlugin(
            tp_size=tp, ep_size=2, zero_stage=zero, precision=precision, max_norm=max_norm
        )
        booster = Booster(plugin=plugin)
    model = _model(name)
    model, opt, *_ = booster.boost(model, _optimizer(kind, model.parameters()))
    assert plugin.ep_group is not None
    losses = []
    data_rank = dist.get_rank(plugin.dp_group)
    for step in range(STEPS):
        loss = _loss(model, _batch(step).chunk(data)[data_rank])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().float().clone()
        dist.all_reduce(whole, group=plugin.dp_group)
        losses.append(whole.item() / data)
    assert losses == pytest.approx(want, rel=rtol, abs=atol), (losses, want)
    if tp > 1:  # the whole state, gathered over tp and ep
        state = plugin.model_state_dict(model)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key].float(), value.float(), rtol=rtol, atol=atol)
        return
    theirs = dict(reference.named_parameters())
    inner = model
    while hasattr(inner, "module"):  # the wrappers (DDP, the edge's) around the model
        inner = inner.module
    ep_rank = dist.get_rank(plugin.ep_group)
    for key, param in inner.named_parameters():
        expected = theirs[key].detach()
        if is_expert_parameter(param):
            local = param.shape[0]
            expected = expected[ep_rank * local : (ep_rank + 1) * local]
        torch.testing.assert_close(param.detach().float(), expected, rtol=rtol, atol=atol)


def _boosted(
    name: str, ep: int, zero: int, tp: int = 1, aux: bool = True
) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    from pc_booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=tp, ep_size=ep, zero_stage=zero, precision="fp32")
    booster = Booster(plugin=plugin)
    model = _model(name, aux=aux)
    model, opt, *_ = booster.boost(model, _optimizer("adamw", model.parameters()))
    return booster, model, opt


def _boosted_elsewhere(
    name: str, plugin_name: str, aux: bool = True
) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """A plugin without expert parallelism: torch DDP ("ddp") or ZeRO-1
    ("zero1"), every expert on every rank."""
    from pc_booster import Booster, LowLevelZeroPlugin, TorchDDPPlugin

    plugin: Any = TorchDDPPlugin() if plugin_name == "ddp" else LowLevelZeroPlugin(stage=1)
    booster = Booster(plugin=plugin)
    model = _model(name, aux=aux)
    model, opt, *_ = booster.boost(model, _optimizer("adamw", model.parameters()))
    return booster, model, opt


def _steps(booster: Any, model: nn.Module, opt: torch.optim.Optimizer, first: int) -> list[float]:
    group = getattr(booster.plugin, "dp_group", None)  # the ranks reading different batches
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    losses = []
    for step in range(first, first + 2):
        loss = _loss(model, _batch(step).chunk(world)[rank])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)
        losses.append(whole.item() / world)
    return losses


def _check_export(name: str, booster: Any, model: nn.Module, path: Path) -> None:
    """transformers' layout from the running job (export_pretrained) and
    from the sharded checkpoint (pc-export): ``from_pretrained`` loads each
    with every expert tensor whole, equal to the gathered model."""
    booster.export_pretrained(model, path / "online", size_per_shard=1)
    whole = booster.plugin.model_state_dict(model)  # collective
    if dist.get_rank() == 0:
        from pc_train.export import main as pc_export

        pc_export([str(path / "model"), str(path / "exported"), "--size-per-shard", "1"])
        reference: Any = _model(name)
        for out in ("online", "exported"):
            loaded = type(reference).from_pretrained(path / out, config=reference.config)
            for key, value in loaded.state_dict().items():
                torch.testing.assert_close(value, whole[key].to(value.dtype), rtol=0, atol=0)
    dist.barrier()


def check_checkpoint(
    name: str, zero: int, root: str, saved_ep: int, loads: list[int | str], tp: int = 1
) -> None:
    """Saved at ``saved_ep`` (and ``tp``), sharded (DCP) and as single
    files, model and optimizer: training goes on bitwise at the same
    layout, and at rtol 1e-5 at each ep of ``loads`` without tensor
    parallelism (1: experts replicated, no expert parallelism) and in each
    plugin named there without expert parallelism ("ddp", "zero1"). Saved under
    tp, the loads read different shares of the batch (world / tp data-
    parallel ranks before, world after), which changes the auxiliary loss
    (a function of each rank's tokens): that case trains without it."""
    path = Path(root) / f"{name}-{zero}-{saved_ep}-{tp}"
    aux = tp == 1
    booster, model, opt = _boosted(name, saved_ep, zero, tp, aux)
    _steps(booster, model, opt, 0)
    booster.save_model(model, path / "model", shard=True)
    booster.save_optimizer(opt, path / "optim", shard=True)
    booster.save_model(model, path / "single")
    booster.save_optimizer(opt, path / "single-optim.pt")
    if tp == 1:
        _check_export(name, booster, model, path)
    want = _steps(booster, model, opt, 2)
    layouts: list[tuple[int | str, int]] = [(saved_ep, tp), *((ep, 1) for ep in loads)]
    for ep, layout_tp in layouts:
        for model_path, optim_path in (("model", "optim"), ("single", "single-optim.pt")):
            if isinstance(ep, str):
                booster, model, opt = _boosted_elsewhere(name, ep, aux)
            else:
                booster, model, opt = _boosted(name, ep, zero, layout_tp, aux)
            booster.load_model(model, path / model_path)
            booster.load_optimizer(opt, path / optim_path)
            got = _steps(booster, model, opt, 2)
            if (ep, layout_tp) == (saved_ep, tp):
                assert got == want, (ep, model_path, got, want)
            else:
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (ep, model_path, got, want)


def check_pipeline(name: str, kind: str, max_norm: float = 0.0, zero: int = 0, tp: int = 1) -> None:
    """ep 2 x pp 2 (world 4, ``zero`` stage): the experts of each stage split
    over its two data-parallel ranks, 1F1B over 2 micro-batches; losses and
    the whole gathered state (the plugin's model_state_dict) against single-
    process training, with the auxiliary loss on: every layer's router
    logits travel to the last stage [Note: router logits through a
    pipeline], where the model's own function computes it per micro-batch
    (so the reference's loss is the mean of the 4 one-row micro-batches')."""
    from pc_booster import Booster, HybridParallelPlugin

    rtol, atol = TOLERANCES[kind]
    reference = _model(name)
    optimizer = _optimizer(kind, reference.parameters())
    want = []
    for step in range(STEPS):
        parts = [_loss(reference, part) for part in _batch(step).chunk(4)]
        loss = torch.stack(parts).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        if max_norm:
            nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    plugin = HybridParallelPlugin(
        pp_size=2, ep_size=2, max_norm=max_norm, zero_stage=zero, tp_size=tp
    )
    booster = Booster(plugin=plugin)
    model = _model(name)
    pipe, opt, *_ = booster.boost(model, _optimizer(kind, model.parameters()))
    dp_rank = dist.get_rank(plugin.dp_group)
    losses = []
    for step in range(STEPS):
        ids = _batch(step).chunk(2)[dp_rank]
        out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), pipe, None, opt)
        opt.step()
        opt.zero_grad()
        whole = out["loss"].detach().reshape(()).clone()
        dist.all_reduce(whole, group=plugin.dp_group)
        losses.append(whole.item() / 2)
    assert losses == pytest.approx(want, rel=rtol, abs=atol), (losses, want)
    state = plugin.model_state_dict(pipe)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key].float(), value.float(), rtol=rtol, atol=atol)


def _pipeline_boosted(name: str, zero: int, ep: int) -> tuple[Any, Any, nn.Module, Any]:
    from pc_booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(pp_size=2, ep_size=ep, zero_stage=zero)
    booster = Booster(plugin=plugin)
    model = _model(name)
    pipe, opt, *_ = booster.boost(model, _optimizer("adamw", model.parameters()))
    return booster, plugin, pipe, opt


def _pipeline_steps(
    booster: Any, plugin: Any, pipe: nn.Module, opt: Any, first: int
) -> list[float]:
    rank, world = dist.get_rank(plugin.dp_group), dist.get_world_size(plugin.dp_group)
    losses = []
    for step in range(first, first + 2):
        ids = _batch(step).chunk(world)[rank]
        batch = iter([{"input_ids": ids, "labels": ids}])
        loss = booster.execute_pipeline(batch, pipe, None, opt)["loss"]
        opt.step()
        opt.zero_grad()
        whole = loss.detach().reshape(()).clone()
        dist.all_reduce(whole, group=plugin.dp_group)
        losses.append(whole.item() / world)
    return losses


def check_pipeline_checkpoint(name: str, zero: int, root: str) -> None:
    """ep 2 x pp 2 (world 4): a sharded checkpoint of the model and the
    optimizer (ZeRO's two parts under ZeRO-1) continues bitwise at the same
    layout, and at rtol 1e-5 at pp 2 without expert parallelism."""
    path = Path(root) / f"pipeline-{name}-{zero}"
    booster, plugin, pipe, opt = _pipeline_boosted(name, zero, 2)
    _pipeline_steps(booster, plugin, pipe, opt, 0)
    booster.save_model(pipe, path / "model", shard=True)
    booster.save_optimizer(opt, path / "optim", shard=True)
    want = _pipeline_steps(booster, plugin, pipe, opt, 2)
    for ep in (2, 1):
        booster, plugin, pipe, opt = _pipeline_boosted(name, zero, ep)
        booster.load_model(pipe, path / "model")
        booster.load_optimizer(opt, path / "optim")
        got = _pipeline_steps(booster, plugin, pipe, opt, 2)
        if ep == 2:
            assert got == want, (got, want)
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)


def check_sequence(name: str, zero: int, mode: str) -> None:
    """ep 2 x Ulysses (or ring) sp 2 at world 4: each sequence split over 2
    ranks, the experts over the 2 ranks of each ep block of the 4 data-
    parallel ones; the losses and the whole state against single-process
    training of the global batch. The auxiliary loss is off: under sequence
    parallelism it is each rank's share's, averaged [Note: auxiliary loss
    under sequence parallelism], which one process does not compute."""
    from pc_booster import Booster, HybridParallelPlugin

    rtol, atol = TOLERANCES["sgd"]
    reference = _model(name, aux=False)
    optimizer = _optimizer("sgd", reference.parameters())
    want = []
    for step in range(STEPS):
        parts = [_loss(reference, part) for part in _batch(step).chunk(2)]
        loss = torch.stack(parts).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    plugin = HybridParallelPlugin(
        ep_size=2, zero_stage=zero, enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode, sp_size=2,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    model = _model(name, aux=False)
    model, opt, *_ = booster.boost(model, _optimizer("sgd", model.parameters()))
    group = plugin.layout.batch_group
    losses = []
    for step in range(STEPS):
        ids = _batch(step).chunk(2)[dist.get_rank(group)]
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)
        losses.append(whole.item() / 2)
    assert losses == pytest.approx(want, rel=rtol, abs=atol), (losses, want)
    state = plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key].float(), value.float(), rtol=rtol, atol=atol)
    _check_aux_once(name, mode)


def _check_aux_once(name: str, mode: str) -> None:
    """With the auxiliary loss on, the loss under sequence parallelism adds
    it once (the mean of the ranks' shares' terms, close to the whole
    sequence's), not once per sequence-parallel rank."""
    from pc_booster import Booster, HybridParallelPlugin

    ids = _batch(0).chunk(2)[0]
    whole = _model(name)
    with torch.no_grad():
        aux_term = (_loss(whole, ids) - _loss(_model(name, aux=False), ids)).item()
    plugin = HybridParallelPlugin(
        enable_sequence_parallelism=True, sequence_parallelism_mode=mode, sp_size=2
    )
    model, *_ = Booster(plugin=plugin).boost(_model(name))
    plain, *_ = Booster(plugin=HybridParallelPlugin(
        enable_sequence_parallelism=True, sequence_parallelism_mode=mode, sp_size=2,
    )).boost(_model(name, aux=False))  # fmt: skip
    with torch.no_grad():
        split = model(input_ids=ids, labels=ids).loss - plain(input_ids=ids, labels=ids).loss
    assert split.item() == pytest.approx(aux_term, rel=0.25), (split.item(), aux_term)


def _loss_in(model: nn.Module, ids: torch.Tensor, precision: str) -> torch.Tensor:
    if precision == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _loss(model, ids).float()
    return _loss(model, ids)  # fp16 too: against fp32 at fp16's tolerance


def check_case(case: str) -> None:
    kind, _, name = case.partition(":")
    if kind.startswith("sequence"):
        _, zero, mode = kind.split("-")
        check_sequence(name, int(zero), mode)
    elif kind.startswith("pipeline_checkpoint"):
        check_pipeline_checkpoint(name, int(kind.split("-")[1]), ROOT)
    elif kind.startswith("pipeline"):
        _, optimizer, *flags = kind.split("-")
        stage = next((int(f[4:]) for f in flags if f.startswith("zero")), 0)
        tp = 2 if "tp2" in flags else 1
        check_pipeline(name, optimizer, CLIP if "clip" in flags else 0.0, stage, tp)
    elif kind.startswith("checkpoint"):
        _, zero, saved, *loads = kind.split("-")
        tp = 2 if "tp2" in loads else 1
        into: list[int | str] = [
            x if x in ("ddp", "zero1") else int(x) for x in loads if x != "tp2"
        ]
        check_checkpoint(name, int(zero), ROOT, int(saved), into, tp)
    elif kind.startswith(("booster", "edge")):
        where, zero, optimizer, precision, *flags = kind.split("-")
        max_norm = CLIP if "clip" in flags else 0.0
        tp = 2 if "tp2" in flags else 1
        check_booster(name, int(zero), optimizer, precision, where == "edge", max_norm, tp)
    elif kind == "capacity":
        check_capacity(name)
    elif kind == "refusals":
        check_refusals()
    else:
        check_parity(name, kind)


CASES = [
    *(f"sgd:{n}" for n in FAMILIES),
    "adamw:mixtral",
    "adamw64:mixtral",
    "adamw64:qwen2_moe",
    "capacity:olmoe",
    "refusals:",
    "booster-0-sgd-fp32:mixtral",
    "booster-1-sgd-fp32:qwen2_moe",
    "booster-1-sgd-fp32:mixtral",
    "booster-1-sgd-fp32:ernie4_5_moe",
    "booster-2-sgd-fp32:olmoe",
    "booster-2-sgd-fp32:granitemoeshared",
    "booster-2-adamw-fp32:qwen3_moe",
    "booster-0-sgd-bf16:mixtral",
    "booster-2-sgd-bf16:qwen2_moe",
    "edge-1-sgd-fp32:olmoe",
    "booster-0-sgd-fp32-clip:mixtral",
    "booster-0-sgd-fp16-clip:qwen2_moe",
    "edge-0-sgd-fp16:olmoe",
    # ZeRO's two optimizers (dense, experts) with one norm and one overflow decision
    "booster-1-sgd-fp32-clip:mixtral",
    "booster-2-adamw-fp32-clip:qwen2_moe",
    "booster-1-sgd-fp16-clip:olmoe",
    "edge-1-sgd-fp16:mixtral",
    "checkpoint-0-2-1-ddp:mixtral",
    "checkpoint-2-2-1-zero1:qwen2_moe",
]
# ep 2 x dp 2: each expert on two ranks, its gradient averaged over them.
WORLD4 = [
    "booster-0-sgd-fp32:mixtral",
    "booster-1-sgd-fp32:ernie4_5_moe",
    "booster-2-adamw-fp32:granitemoeshared",
    "booster-0-adamw-fp32-clip:qwen3_moe",
    "booster-0-sgd-fp32-tp2:mixtral",
    "booster-1-sgd-fp32-tp2:qwen2_moe",
    "booster-0-sgd-fp32-clip-tp2:olmoe",
    "sequence-0-all_to_all:mixtral",
    "sequence-1-all_to_all:qwen2_moe",
    "pipeline-sgd:mixtral",
    "pipeline-sgd-clip:qwen2_moe",
    "pipeline-sgd:olmoe",
    "pipeline-sgd:ernie4_5_moe",
    "pipeline-sgd-zero1:mixtral",
    "pipeline-sgd-clip-zero1:olmoe",
    "pipeline_checkpoint-1:mixtral",
    "booster-2-sgd-fp32-clip:ernie4_5_moe",
    "checkpoint-1-2-1-4:mixtral",
    "checkpoint-0-2-2-4-tp2:olmoe",
]


ROOT = ""  # the test's temporary directory, set in the ranks by run_subtests' args


def _with_root(root: str, case: str) -> None:
    global ROOT
    ROOT = root
    check_case(case)


def test_expert_parallel_matches_single_process(tmp_path: Path) -> None:
    run_subtests(_with_root, 2, {"case": CASES}, args=(str(tmp_path),), timeout=280)


def test_expert_parallel_with_data_parallel_matches_single_process(tmp_path: Path) -> None:
    run_subtests(_with_root, 4, {"case": WORLD4}, args=(str(tmp_path),), timeout=280)


# tp 2 x pp 2 x ep 2: the attention split over tp, the blocks over two
# stages, each stage's experts over its two data-parallel ranks.
WORLD8 = ["pipeline-sgd-clip-tp2:qwen2_moe", "pipeline-sgd-zero1-tp2:mixtral"]


def test_expert_parallel_with_tensor_and_pipeline_parallel(tmp_path: Path) -> None:
    run_subtests(_with_root, 8, {"case": WORLD8}, args=(str(tmp_path),), timeout=280)
