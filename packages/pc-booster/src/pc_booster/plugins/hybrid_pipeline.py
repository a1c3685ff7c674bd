"""The pipeline half of :class:`~pc_booster.plugins.hybrid.HybridParallelPlugin`:
cutting a ``transformers`` model into stages (:mod:`pc_booster.pipeline`),
materialising and placing only this rank's stage, the groups that sum a
weight tied across stages, and one step through the schedule with the
loss scaled for fp16 and the criterion called as ``criterion(outputs, inputs)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import rebuild_optimizer
from pc_booster.pipeline import SequenceShare, feed_inputs, pipeline_layers, router_recorder
from pc_booster.plugin import Boosted, BoostRequest
from pc_booster.plugins.common import (
    autocast_forward,
    broadcast_module,
    cast_floating,
    device,
    has_lazy,
    materialize_lazy,
    sharded,
    values_a_cast_rounds,
)
from pc_booster.plugins.low_level_zero import masters_from_built
from pc_booster.plugins.pipeline_tp import (
    other_stages_to_meta,
    shard_tensor_parallel,
    stage_balance,
)
from pc_booster.rules import TrainPrecision

if TYPE_CHECKING:
    from pc_booster.plugins.hybrid import HybridParallelPlugin

__all__ = ["PipelineStage", "StageOutput", "configure_pipeline", "execute_pipeline"]


@dataclass
class PipelineStage:
    """What :func:`configure_pipeline` learns about this rank's stage, for
    the step and the state functions (:mod:`.hybrid_state`)."""

    #: the loss the last stage computes: causal, sequence, pooled or token
    loss_kind: str = "causal"
    #: the model's config, for classification losses
    loss_config: Any = None
    #: parameter name -> the stage holding it (every alias of a tied weight)
    stage_of: dict[str, int] = field(default_factory=dict)
    #: the names of this rank's parameters; None until configured
    stage_params: frozenset[str] | None = None
    #: weights tied across stages, each with the group that sums its gradient
    tied: list[tuple[nn.Parameter, dist.ProcessGroup]] = field(default_factory=list)
    #: the weight of a mixture-of-experts model's auxiliary loss in its loss
    aux_coefficient: float = 0.0


class StageOutput:
    """What the last stage's criterion gets as ``outputs`` for one
    micro-batch, shaped like a ``transformers`` model output: ``logits``
    (vocabulary-parallel under tensor parallelism), and ``loss``, the
    model's own loss on the micro-batch's ``labels`` (its ``input_ids``
    when it has none), computed when first read, with a mixture-of-experts
    model's auxiliary loss added as the model adds it (``aux_loss``)."""

    def __init__(
        self,
        logits: torch.Tensor,
        loss: Callable[[], torch.Tensor],
        aux_loss: torch.Tensor | None = None,
    ) -> None:
        self.logits = logits
        self._compute_loss = loss
        #: a mixture-of-experts model's auxiliary loss of the micro-batch
        #: (included in ``loss`` with the model's coefficient), else None
        self.aux_loss = aux_loss

    @cached_property
    def loss(self) -> torch.Tensor:
        return self._compute_loss()

    def __getitem__(self, key: int | str) -> torch.Tensor:
        # As a transformers output computed with labels: (loss, logits).
        if key in (0, "loss"):
            return self.loss
        if key in (1, "logits"):
            return self.logits
        raise KeyError(
            f"a pipeline stage's output has 0 / 'loss' and 1 / 'logits' (a transformers "
            f"output computed with labels), not {key!r}"
        )


def _sequence_share(plugin: HybridParallelPlugin) -> SequenceShare | None:
    """Ulysses or ring attention inside the stages: this rank's positions."""
    if plugin.sp_size == 1:
        return None
    from pc_tensor import sequence_positions

    group = plugin.layout.sp_group
    assert group is not None
    zigzag = plugin.options.sequence_parallelism_mode == "ring_attn"

    def positions(total: int, where: torch.device) -> torch.Tensor:
        return sequence_positions(total, group, zigzag=zigzag, device=where)

    return SequenceShare(positions, plugin.sp_size)


def _stage_layout(plugin: HybridParallelPlugin, model: nn.Module) -> tuple[Any, list[int]]:
    share = _sequence_share(plugin)
    if share is not None:
        from pc_tensor import sequence_attention

        assert plugin.layout.sp_group is not None
        mode = plugin.options.sequence_parallelism_mode
        assert mode is not None
        sequence_attention(model, plugin.layout.sp_group, mode)
    layers, plugin.stage.loss_kind = pipeline_layers(model, share)
    plugin.stage.loss_config = getattr(model, "config", None)
    if plugin.stage.loss_kind == "causal" and router_recorder(model) is not None:
        from pc_tensor.hooks import aux_loss_coefficient

        plugin.stage.aux_coefficient = aux_loss_coefficient(model)
    plugin.validate_later(layers=len(layers) - 2)
    from pc_pipeline import Sequential

    return Sequential(*layers), stage_balance(plugin, len(layers))


def configure_pipeline(
    plugin: HybridParallelPlugin, request: BoostRequest, names: dict[int, str]
) -> Boosted:
    """Build this rank's stage(s) and the pipeline over them. Only this
    stage's layers are materialised ([Note: only this stage is materialised
    under tensor parallelism] in ``pc_booster.plugins.pipeline_tp``)."""
    from pc_pipeline import partition

    model, optimizer, precision = request.model, request.optimizer, request.precision
    layout, o = plugin.layout, plugin.options
    if o.tp_size > 1:
        if has_lazy(model):
            other_stages_to_meta(plugin, model)
        shard_tensor_parallel(plugin, model)
    sequence, balance = _stage_layout(plugin, model)
    pp_rank, pp = layout.coord.pp, o.pp_size

    def stage_modules(rank: int) -> list[nn.Module]:
        part = partition(sequence, rank, pp, o.chunks_per_rank(), balance=balance)
        return list(part) if isinstance(part, list) else [part]

    mine = stage_modules(pp_rank)
    built = _place_stage(plugin, mine, precision)
    own = _record_stages(plugin, model, [stage_modules(rank) for rank in range(pp)])
    pipe = _schedule(plugin, mine)
    if optimizer is not None and o.zero_stage and o.ep_size > 1:
        from pc_booster.plugins.experts import expert_zero

        own_names = {id(p): n for n, p in own.items()}
        optimizer = expert_zero(plugin, optimizer, names, model, built, own_names)
    elif optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, names, own, skip_missing=True)
        own_names = {id(p): n for n, p in own.items()}
        if o.zero_stage:
            zero = plugin.zero_optimizer(optimizer, own_names)
            masters_from_built(model, zero, built)
            optimizer = zero
    else:
        own_names = {}
    step_policy = plugin.step_policy(precision, own_names)
    return request.boosted(pipe, optimizer, module=model, step_policy=step_policy)


def _place_stage(
    plugin: HybridParallelPlugin, mine: list[nn.Module], precision: TrainPrecision
) -> dict[int, torch.Tensor]:
    """This stage's layers on the device, from its first data-parallel
    rank's values, in the compute dtype (or fp32 under autocast without
    ZeRO); returns the values as built (ZeRO's masters)."""
    o = plugin.options
    if o.tp_size == 1:  # only this stage's layers are materialised and placed
        materialize_lazy(mine, device())
        for module in mine:
            module.to(device())
            # The ranks of this stage start from its first data-parallel rank's values.
            broadcast_module(module, plugin.layout.dp_group)
    if o.ep_size > 1:  # this stage's experts split over its ep ranks
        from pc_tensor import find_experts, shard_experts

        for module in mine:
            if find_experts(module):
                shard_experts(module, plugin.layout.ep_group)
    built = values_a_cast_rounds(mine, precision.dtype) if o.zero_stage else {}
    amp = not o.zero_stage and precision is not TrainPrecision.FP32
    for module in mine:
        if amp:  # [Note: mixed precision without ZeRO] in hybrid.py, stage by stage
            cast_floating(module, torch.float32)
            autocast_forward(module, precision.dtype)
        else:
            cast_floating(module, precision.dtype)
    return built


def _record_stages(
    plugin: HybridParallelPlugin, model: nn.Module, stages: list[list[nn.Module]]
) -> dict[str, nn.Parameter]:
    """Which stage holds each parameter (``plugin.stage``), the groups that
    sum a weight tied across stages (each starting from the stage that
    trains it); returns this stage's parameters by name."""
    holders: dict[int, list[int]] = {}  # parameter id -> pp ranks holding it
    for rank, modules in enumerate(stages):
        for module in modules:
            for param in module.parameters():
                if rank not in holders.setdefault(id(param), []):
                    holders[id(param)].append(rank)
    by_name = dict(model.named_parameters())
    stage = plugin.stage
    stage.stage_of = {  # every alias of a tied weight too (BERT's decoder bias)
        n: holders[id(p)][0]
        for n, p in model.named_parameters(remove_duplicate=False)
        if id(p) in holders
    }
    pp_rank = plugin.layout.coord.pp
    own = {n: p for n, p in by_name.items() if pp_rank in holders.get(id(p), [])}
    stage.stage_params = frozenset(own)
    stage.tied = _tie_groups(plugin, holders, by_name)
    with torch.no_grad():  # a tied weight starts from the stage that trains it
        for param, group in stage.tied:
            dist.broadcast(param.data, dist.get_global_rank(group, 0), group=group)
    return own


def _schedule(plugin: HybridParallelPlugin, mine: list[nn.Module]) -> nn.Module:
    """The schedule over this rank's stage(s), each in DDP over the
    data-parallel ranks without ZeRO."""
    from pc_comm import DistributedDataParallel
    from pc_pipeline import Interleaved1F1B, PipeDream, ZeroBubble
    from pc_tensor import is_expert_parameter

    layout, o = plugin.layout, plugin.options
    experts = [p for m in mine for p in m.parameters() if is_expert_parameter(p)]
    if experts:  # [Note: expert gradients without ZeRO]
        from pc_booster.plugins.experts import ExpertGradientSync

        ExpertGradientSync(experts, layout.expert_data_group)
    if not o.zero_stage and dist.get_world_size(layout.dp_group) > 1:
        # Buffers are synchronised once, at placement: re-broadcasting them
        # every micro-batch would overwrite tensors earlier micro-batches'
        # graphs still hold (BERT's token_type_ids).
        mine = [
            DistributedDataParallel(
                m,
                process_group=layout.dp_group,
                broadcast_buffers=False,
                bucket_cap_mb=o.ddp_bucket_cap_mb,
                # A module held by several stages (a cut inferred from the
                # module tree puts the final norm on the first stage too) may
                # go unused on some: its gradient comes from the tie's sum.
                find_unused_parameters=o.find_unused_parameters or bool(plugin.stage.tied),
                gradient_as_bucket_view=o.gradient_as_bucket_view,
                ignored_parameters=[p for p in m.parameters() if is_expert_parameter(p)],
            )
            for m in mine
        ]
    chunks, wait = o.microbatches(), o.pp_timeout
    if o.pp_style == "interleaved":
        return Interleaved1F1B(mine, chunks, layout.pp_group, timeout=wait, scale_grads=True)
    if o.pp_style == "zbv":
        return ZeroBubble(mine[0], chunks, layout.pp_group, timeout=wait, scale_grads=True)
    return PipeDream(mine[0], chunks, layout.pp_group, timeout=wait, scale_grads=True)


def _tie_groups(
    plugin: HybridParallelPlugin, holders: dict[int, list[int]], by_name: dict[str, nn.Parameter]
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """Groups summing the gradients of weights held by several stages (an
    LM head tied to the embedding): one group per tie and per data/tensor-
    parallel position, made by every rank in one order."""
    layout = plugin.layout
    dims, me = layout.dims, layout.coord
    ties = sorted({tuple(r) for r in holders.values() if len(r) > 1})
    out: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
    for tie in ties:
        for d in range(dims.dp):
            for t in range(dims.tp):
                ranks = tuple((d * dims.pp + p) * dims.tp + t for p in tie)
                group = layout.group_over(ranks)
                if d == me.dp and t == me.tp and me.pp in tie:
                    for param in by_name.values():
                        if tuple(holders.get(id(param), ())) == tie:
                            out.append((param, group))
    return out


def pooled(plugin: HybridParallelPlugin, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sequence classification: each row's logits at its last token that is
    not padding, as transformers' models pool them."""
    config = plugin.stage.loss_config
    pad = getattr(config.get_text_config(), "pad_token_id", None) if config is not None else None
    rows = torch.arange(logits.shape[0], device=logits.device)
    if pad is None:
        return logits[rows, -1]
    mask = (ids != pad).to(logits.device, torch.int32)
    positions = torch.arange(ids.shape[-1], device=logits.device, dtype=torch.int32)
    return logits[rows, (positions * mask).argmax(-1)]


def lm_loss(
    plugin: HybridParallelPlugin,
    logits: torch.Tensor,
    labels: torch.Tensor,
    aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's own loss: causal (shifted) or masked LM, vocabulary-
    parallel under tensor parallelism, with a mixture-of-experts model's
    auxiliary loss ``aux`` times its coefficient; sequence classification on
    the pooled logits, token classification per position, as transformers
    computes them (regression, single- or multi-label by the config)."""
    term = None if aux is None else plugin.stage.aux_coefficient * aux.reshape(()).float()
    if plugin.stage.loss_kind in ("sequence", "pooled", "token"):
        from transformers.loss.loss_utils import (
            ForSequenceClassificationLoss,
            ForTokenClassification,
        )

        if plugin.stage.loss_kind in ("sequence", "pooled"):
            loss: torch.Tensor = ForSequenceClassificationLoss(
                labels, logits, plugin.stage.loss_config
            )
        else:
            loss = ForTokenClassification(logits, labels, plugin.stage.loss_config)
        return loss
    if plugin.stage.loss_kind == "causal" and plugin.sp_size > 1:
        from pc_tensor import sequence_lm_loss

        group = plugin.layout.sp_group
        assert group is not None
        return sequence_lm_loss(
            logits,
            labels,
            group,
            zigzag=plugin.options.sequence_parallelism_mode == "ring_attn",
            grad_scale=float(plugin.sp_size),
            rank_term=term,  # [Note: auxiliary loss under sequence parallelism]
        )
    if plugin.stage.loss_kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if plugin.tp_size > 1:
        from pc_tensor import vocab_parallel_cross_entropy

        loss = vocab_parallel_cross_entropy(flat, target, plugin.layout.tp_group)
    else:
        loss = nn.functional.cross_entropy(flat.float(), target)
    return loss if term is None else loss + term


def _split_output(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last stage's output: the logits, and a mixture-of-experts
    model's auxiliary loss when it has one [Note: router logits through a
    pipeline]."""
    if isinstance(output, tuple):
        return output[0], output[1]
    return output, None


def execute_pipeline(
    plugin: HybridParallelPlugin,
    data_iter: Iterator[Any],
    model: nn.Module,
    criterion: Any,
    optimizer: Optimizer,
    return_loss: bool = True,
    return_outputs: bool = False,
) -> dict[str, Any]:
    """One step's forward and backward through the pipeline on the next
    batch of ``data_iter`` (a dict of batch-first tensors with
    ``input_ids``, or a tensor of ids), split into micro-batches.

    ``criterion(outputs, inputs)`` (docs/migrate-colossalai.md): ``outputs`` a
    :class:`StageOutput` of the micro-batch (``.logits``, ``.loss``),
    ``inputs`` the micro-batch's dict; it returns the micro-batch's mean
    loss. None means ``outputs.loss``. Under fp16 the loss is multiplied by
    the ZeRO optimizer's loss scale before backward (the optimizer divides
    the gradients by it and decides overflow over every stage).

    Returns ``{"loss", "outputs"}``: the mean loss over the micro-batches
    (unscaled) on every rank, and the last stage's logits there (None
    elsewhere). Without an optimizer, or under ``torch.no_grad()``, the
    batch only goes forward (evaluation): the loss is the criterion's on the
    whole batch, ``outputs`` ``{"logits": ...}`` on the last stage."""
    if plugin.pp_size == 1:
        raise ValueError("execute_pipeline needs pp_size > 1; call the model directly.")
    inputs, main = _batch_inputs(plugin, model, next(data_iter))
    keys = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    user: Callable[[Any, dict[str, Any]], torch.Tensor] = (
        criterion if criterion is not None else lambda outputs, _: outputs.loss
    )
    if optimizer is None or not torch.is_grad_enabled():
        return _evaluate(plugin, model, inputs, main, keys, user, return_loss, return_outputs)
    zero = _zero_of(optimizer) if plugin.zero_stage else None  # once a step
    scaler = zero.scaler if zero is not None else None
    policy = plugin.boosted(model).step_policy
    if policy is not None and policy.amp is not None:  # fp16 without ZeRO
        scaler = policy.amp.scaler
    scale = float(scaler.scale) if scaler is not None else 1.0

    def loss_fn(output: Any, *parts: torch.Tensor) -> torch.Tensor:
        micro = dict(zip(keys, parts, strict=True))
        labels = micro["labels"] if "labels" in micro else micro[main]
        logits, aux = _split_output(output)
        if plugin.stage.loss_kind == "sequence":
            logits = pooled(plugin, logits, micro[main])
        out = StageOutput(logits, lambda: lm_loss(plugin, logits, labels, aux), aux)
        loss = user(out, micro)
        return loss * scale if scale != 1.0 else loss

    context: AbstractContextManager[None] = (
        zero.no_sync() if zero is not None and plugin.zero_stage == 1 else nullcontext()
    )
    with context:
        losses, outputs = model.forward_backward(  # type: ignore[operator]
            inputs[main],
            criterion=loss_fn,
            labels=tuple(inputs[k] for k in keys),
            return_outputs=return_outputs,
        )
    _sum_tied_gradients(plugin, zero)
    if outputs is not None:
        outputs = _split_output(outputs)[0]
    loss = (
        losses.detach().float().mean() / scale
        if losses is not None
        else torch.zeros((), device=device())
    )
    layout = plugin.layout
    last = dist.get_global_rank(layout.pp_group, plugin.pp_size - 1)
    dist.broadcast(loss, last, group=layout.pp_group)
    return {"loss": loss if return_loss else None, "outputs": outputs}


def _zero_of(optimizer: Optimizer) -> Any:
    """The ZeRO optimizer behind ``optimizer`` (under expert parallelism
    the dense and expert ones stepped as one, which accumulate, scale and
    sum tied gradients as one)."""
    from pc_booster.plugins.experts import ExpertParallelOptimizer
    from pc_booster.wrappers import inner_optimizer

    inner = inner_optimizer(optimizer)
    return inner if isinstance(inner, ExpertParallelOptimizer) else sharded(optimizer)


def _batch_inputs(
    plugin: HybridParallelPlugin, model: nn.Module, batch: Any
) -> tuple[dict[str, Any], str]:
    """The batch as a dict holding the model's main input (fed to the first
    stage), and that input's name; the micro-batch count set from
    ``microbatch_size`` when given."""
    main = str(getattr(plugin.boosted(model).module, "main_input_name", "input_ids"))
    inputs = batch if isinstance(batch, dict) else {main: batch}
    if main not in inputs:
        raise ValueError(
            f"execute_pipeline feeds the first stage {main!r}; the batch has "
            f"{sorted(inputs)}. Pass a dict with {main} (and labels), or a tensor of them."
        )
    feed_inputs(model, inputs[main])
    size = plugin.options.microbatch_size
    if size is not None:  # microbatch_size: the count follows the batch
        rows = inputs[main].shape[0]
        if rows % size:
            raise ValueError(
                f"execute_pipeline: the batch's {rows} rows do not split into micro-batches of "
                f"microbatch_size={size}; pass a batch whose size is a multiple of it."
            )
        model.set_chunks(rows // size)  # type: ignore[operator]
    return inputs, main


def _sum_tied_gradients(plugin: HybridParallelPlugin, zero: Any) -> None:
    """A weight tied across stages gets the sum of every holder's gradient
    (``zero``: the ZeRO optimizer, where there is one)."""
    for param, group in plugin.stage.tied:
        if zero is not None and plugin.zero_stage == 1:
            grad = zero.accumulated_grad(param)
        else:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
        dist.all_reduce(grad, group=group)


def _evaluate(
    plugin: HybridParallelPlugin,
    model: nn.Module,
    inputs: dict[str, Any],
    main: str,
    keys: list[str],
    user: Callable[[Any, dict[str, Any]], torch.Tensor],
    return_loss: bool,
    return_outputs: bool,
) -> dict[str, Any]:
    """execute_pipeline's forward-only pass (evaluation)."""
    with torch.no_grad():
        output = model(inputs[main])  # the last stage's output, None elsewhere
        logits, aux = _split_output(output)
        loss = torch.zeros((), device=device())
        if logits is not None:
            batch = {k: inputs[k] for k in keys}
            labels = batch["labels"] if "labels" in batch else batch[main]
            if plugin.stage.loss_kind == "sequence":
                logits = pooled(plugin, logits, batch[main])
            final = logits
            if aux is not None:  # one per micro-batch: the model's on each, averaged
                aux = aux.float().mean()
            out = StageOutput(final, lambda: lm_loss(plugin, final, labels, aux), aux)
            loss = user(out, batch).detach().float().to(loss.device)
    layout = plugin.layout
    last = dist.get_global_rank(layout.pp_group, plugin.pp_size - 1)
    dist.broadcast(loss, last, group=layout.pp_group)
    outputs = {"logits": logits} if return_outputs and logits is not None else None
    return {"loss": loss if return_loss else None, "outputs": outputs}
