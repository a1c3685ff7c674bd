"""Tensor x pipeline x data parallelism (:class:`HybridParallelPlugin`):
pc-tensor's ``shard_model`` over the tensor-parallel ranks, pc-pipeline's
stages over the pipeline ranks (:mod:`.hybrid_pipeline`), and pc-comm's DDP
or ZeRO-1/2 over the data-parallel ranks; its state conversions are in
:mod:`.hybrid_state`. Ranks are laid out tp innermost
(``pc_comm.make_subgroups``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.canonical import CanonicalOptimizerState, names_by_id, rebuild_optimizer
from pc_booster.plugin import Boosted, BoostRequest, Plugin, SupportsNoSync, SupportsPipeline
from pc_booster.plugins import hybrid_experts_state, hybrid_pipeline, hybrid_state
from pc_booster.plugins.common import (
    autocast_forward,
    broadcast_module,
    cast_floating,
    cast_floating_inputs,
    device,
    full_logits,
    materialize_lazy,
    require_initialized,
    sharded,
    split_over_tp,
    values_a_cast_rounds,
)
from pc_booster.plugins.experts import configure_experts
from pc_booster.plugins.hybrid_options import OWN_SP_MODES, HybridParallelOptions
from pc_booster.plugins.layout import ParallelLayout, PipelineStageManager
from pc_booster.plugins.low_level_zero import (
    masters_from_built,
    zero_after_sharded_optimizer_load,
    zero_sharded_model_state,
    zero_sharded_optimizer_state,
)
from pc_booster.plugins.optimizations import apply_optimizations
from pc_booster.plugins.sharded import (
    GROUPS,
    Share,
    after_own_optimizer_load,
    own_optimizer_state,
    whole_state,
)
from pc_booster.rules import (
    TrainPrecision,
)
from pc_booster.step_policies import AmpStep, Clip, GradientStep
from pc_chunk import is_lazy

__all__ = ["HybridParallelOptions", "HybridParallelPlugin"]


class HybridParallelPlugin(Plugin, SupportsNoSync, SupportsPipeline):
    """Tensor parallelism (pc-tensor's ``shard_model``, optionally with
    sequence parallelism) x pipeline parallelism x data parallelism
    (:class:`HybridParallelOptions`). ``layout``: the process groups, built
    once per job and shared by plugins of the same sizes (default: built on
    first use)."""

    options: HybridParallelOptions

    takes_precision = True

    OPTIONS = HybridParallelOptions
    POSITIONAL = ("tp_size", "pp_size")

    def __init__(
        self,
        *args: Any,
        precision: str | None = None,
        layout: ParallelLayout | None = None,
        **fields: Any,
    ) -> None:
        """``HybridParallelPlugin(tp_size=2, pp_size=2, ...)``: the fields of
        :class:`HybridParallelOptions` (or the options object), ``precision=``
        and ``layout=``, process groups already made for these sizes
        [Note: options declared once]."""
        if fields.get("num_layers_per_stage") is not None:
            fields["num_layers_per_stage"] = tuple(fields["num_layers_per_stage"])
        super().__init__(self.options_of(args, fields))
        self.set_precision(precision)
        o = self.options
        if layout is not None and (layout.tp_size, layout.pp_size) != (o.tp_size, o.pp_size):
            raise ValueError(
                f"HybridParallelPlugin: layout has tp {layout.tp_size} x pp {layout.pp_size}, the "
                f"plugin tp_size {o.tp_size} x pp_size {o.pp_size}; pass a layout of the same "
                "sizes."
            )
        # The process groups: built once, on first use (every rank then).
        self._layout = layout
        # Set by configure: this rank's pipeline stage.
        self.stage = hybrid_pipeline.PipelineStage()

    # The layout's sizes and groups, by the names training scripts read.
    @property
    def tp_size(self) -> int:
        return self.options.tp_size

    @property
    def pp_size(self) -> int:
        return self.options.pp_size

    @property
    def zero_stage(self) -> int:
        return self.options.zero_stage

    @property
    def ep_size(self) -> int:
        return self.options.ep_size

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks that split each MoE block's experts (None: ep_size 1)."""
        return self.layout.ep_group

    @property
    def steps_whole_tensors(self) -> bool:
        return self.zero_stage == 0 and self.options.tp_size == 1

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            require_initialized("HybridParallelPlugin")
            self._layout = ParallelLayout.build(
                tp=self.tp_size, pp=self.pp_size, sp=self.sp_size, ep=self.ep_size
            )
        return self._layout

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that read different batches (Ulysses' sequence-parallel
        ranks share one); gradients are averaged over ``layout.dp_group``."""
        return self.layout.batch_group

    @property
    def sp_size(self) -> int:
        """Ulysses' sequence-parallel ranks (1 unless all_to_all)."""
        o = self.options
        return o.sp_size if o.sequence_parallelism_mode in OWN_SP_MODES and o.sp_size else 1

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.layout.sp_group

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.layout.tp_group

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.layout.pp_group

    @property
    def stage_manager(self) -> PipelineStageManager | None:
        if self.pp_size == 1:
            return None
        chunks = 2 if self.options.pp_style in ("interleaved", "zbv") else 1
        return PipelineStageManager(self.layout.pp_group, num_model_chunks=chunks)

    def configure(self, request: BoostRequest) -> Boosted:
        model, optimizer, precision = request.model, request.optimizer, request.precision
        names = names_by_id(model)
        apply_optimizations(model, self.options)
        if self.pp_size > 1:
            return hybrid_pipeline.configure_pipeline(self, request, names)
        model = self._place(model)
        built = values_a_cast_rounds([model], precision.dtype) if self.zero_stage else {}
        amp = not self.zero_stage and precision is not TrainPrecision.FP32
        if amp:  # [Note: mixed precision without ZeRO]
            cast_floating(model, torch.float32)
            autocast_forward(model, precision.dtype)
        else:
            cast_floating(model, precision.dtype)
            if precision is not TrainPrecision.FP32:  # an fp32 batch into a half model
                cast_floating_inputs(model, precision.dtype)
        wrapped: nn.Module = model
        if self.ep_size > 1:
            return configure_experts(self, request, model, names, built)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
        if self.zero_stage:
            if optimizer is None:
                raise ValueError("zero_stage > 0 shards an optimizer: pass one to boost().")
            zero = self.zero_optimizer(optimizer)
            masters_from_built(model, zero, built)
            optimizer = zero
        else:
            wrapped = self._data_parallel(model)
        step_policy = self.step_policy(precision)
        if self.tp_size > 1 and not self.options.parallel_output:
            model.register_forward_hook(full_logits)
        return request.boosted(wrapped, optimizer, module=model, step_policy=step_policy)

    def _place(self, model: nn.Module) -> nn.Module:
        """The model on the device, every rank from the same values, split
        over the tensor-parallel ranks and wrapped for sequence parallelism."""
        layout = self.layout
        if self.tp_size > 1:
            split_over_tp(model, layout.tp_group, self.tp_policy(model), self.options.megatron_sp())
        else:
            materialize_lazy([model], device())
            model = model.to(device())
            broadcast_module(model)
        if self.ep_size > 1:  # every rank holds the same values here
            from pc_tensor import shard_experts

            shard_experts(model, layout.ep_group)
        if self.sp_size > 1:  # gradients averaged over dp x sp, so scaled by sp
            from pc_tensor import ring_model, ulysses_model

            assert layout.sp_group is not None
            wrap = (
                ulysses_model
                if self.options.sequence_parallelism_mode == "all_to_all"
                else ring_model
            )
            wrap(model, layout.sp_group, grad_scale=float(self.sp_size))
        return model

    def tp_policy(self, model: nn.Module) -> Any:
        """The tensor-parallel policy (None: shard_model's default). Under
        expert parallelism, the family's plan without its expert entries:
        attention and dense layers split over tp, experts kept whole there
        and split over ep instead."""
        if self.ep_size == 1:
            return None
        from pc_tensor import plan_policy

        return plan_policy(model, skip_experts=True)

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        """Without ZeRO: the model in DDP over the data-parallel ranks."""
        from pc_comm import DistributedDataParallel

        group, o = self.layout.dp_group, self.options
        if dist.get_world_size(group) == 1:
            return model
        return DistributedDataParallel(
            model,
            process_group=group,
            bucket_cap_mb=o.ddp_bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            broadcast_buffers=o.broadcast_buffers,
        )

    # -- clipping and loss scaling across every group holding gradients ---------------

    def counts_toward_norm(
        self, param: torch.Tensor, name: str | None = None, over_ep: bool = True
    ) -> bool:
        """Whether this rank counts ``param`` in the global gradient norm:
        each weight once across the model-parallel ranks (a tensor-parallel
        shard on every tp rank, a replicated weight on tp rank 0; a weight
        tied across stages on the stage that trains it; with ``over_ep``, a
        dense weight on ep rank 0, where the norm is summed over the ep
        group)."""
        layout = self.layout
        if self.tp_size > 1 and not self._tp_counts(param):
            return False
        if self.ep_size > 1 and over_ep and not self._ep_counts(param):
            return False
        if self.pp_size > 1 and name is not None:
            return self.stage.stage_of.get(name, layout.coord.pp) == layout.coord.pp
        return True

    @cached_property
    def _tp_counts(self) -> Callable[[torch.Tensor], bool]:
        """pc-zero's tensor-parallel rule: sharded weights on every tp rank,
        replicated ones on tp rank 0."""
        from pc_zero import counts_under_tensor_parallel

        return counts_under_tensor_parallel(self.layout.tp_group)

    def _ep_counts(self, param: torch.Tensor) -> bool:
        """Under expert parallelism the norm is summed over the ep group: an
        expert shard counts on every rank, a dense weight (the same on every
        rank after DDP) on ep rank 0."""
        from pc_tensor import is_expert_parameter

        group = self.layout.ep_group
        return is_expert_parameter(param) or group is None or dist.get_rank(group) == 0

    def norm_groups(self) -> list[dist.ProcessGroup]:
        groups = []
        if self.ep_size > 1 and self.layout.ep_group is not None:
            groups.append(self.layout.ep_group)
        if self.tp_size > 1:
            groups.append(self.layout.tp_group)
        if self.pp_size > 1:
            groups.append(self.layout.pp_group)
        return groups

    def zero_optimizer(
        self,
        optimizer: Optimizer,
        names: dict[int, str] | None = None,
        experts: bool | None = None,
    ) -> Any:
        """ZeRO over the data-parallel ranks, clipping by (and deciding fp16
        overflow on) the norm over the tensor and pipeline ranks too. Under
        expert parallelism one over the dense parameters (``experts``
        False: their norm over the data-parallel ranks, which hold pieces of
        the same weights) and one over the expert shards (True: over the
        expert-data-parallel ranks, then the ep group, whose ranks hold
        different experts), stepped as one [Note: expert-parallel optimizer]."""
        from pc_zero import LowLevelZeroOptimizer

        o = self.options
        by_id = names or {}
        layout = self.layout
        groups = self.norm_groups()
        if experts is False:
            groups = [g for g in groups if g is not layout.ep_group]
        over_ep = experts is None
        return LowLevelZeroOptimizer(
            optimizer,
            stage=o.zero_stage,
            dp_process_group=layout.expert_data_group if experts else layout.dp_group,
            model_parallel_groups=groups,
            counts_toward_norm=lambda p: self.counts_toward_norm(p, by_id.get(id(p)), over_ep),
            max_norm=o.max_norm,
            loss_scale=o.loss_scale(),
            overlap_communication=o.overlap_communication,
            cpu_offload=o.cpu_offload,
            reduce_bucket_size=int(o.zero_bucket_size_in_m * 2**20),
        )

    def step_policy(
        self, precision: TrainPrecision, names: dict[int, str] | None = None
    ) -> GradientStep:
        """How a boosted optimizer steps [Note: one step policy]. With ZeRO,
        its optimizer unscales and clips inside the step. Without, the
        user's optimizer's gradients (whole on each data-parallel rank after
        DDP) are clipped by their global norm over the tensor and pipeline
        ranks (each piece counted once), and fp16's overflow check spans
        them too. ``names``: parameter names by id, for what counts toward
        the norm under a pipeline."""
        if self.zero_stage:
            return GradientStep("HybridParallelPlugin")
        amp = None
        if precision is TrainPrecision.FP16:
            amp = AmpStep(self.options.loss_scale(), device(), groups=self.norm_groups())
        return GradientStep(
            "HybridParallelPlugin", self._norm_clip(names or {}), self.options.max_norm, amp
        )

    def _norm_clip(self, by_id: dict[int, str]) -> Clip:
        from pc_zero import unscale_clip_and_check

        def clip(params: Sequence[torch.Tensor], max_norm: float) -> float:
            # The gradients themselves (scaled in place), not flattened copies.
            grads = [p.grad for p in params if p.grad is not None]
            counted = [
                [(0, g.numel())] if self.counts_toward_norm(p, by_id.get(id(p))) else []
                for p, g in zip(params, grads, strict=True)
            ]
            _, norm = unscale_clip_and_check(
                grads,
                None,
                None,
                max_norm,
                device(),
                count_ranges=counted,
                model_parallel_groups=self.norm_groups(),
            )
            return norm

        return clip

    # -- steps -------------------------------------------------------------------------

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Optimizer,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One step's forward and backward through the pipeline on the next
        batch of ``data_iter`` [see :func:`.hybrid_pipeline.execute_pipeline`].
        Then call ``optimizer.step()``."""
        return hybrid_pipeline.execute_pipeline(
            self, data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]:
        self.validate_later(accumulation=2)  # refused with pipelines
        if self.zero_stage == 1:
            if optimizer is None:
                raise ValueError(
                    "with zero_stage=1 gradients accumulate in the optimizer: pass it, "
                    "booster.no_sync(model, optimizer)."
                )
            context: AbstractContextManager[None] = sharded(optimizer).no_sync()
            return context
        from pc_comm import DistributedDataParallel

        if self.zero_stage == 2 or not isinstance(model, DistributedDataParallel):
            return nullcontext()  # ZeRO-2 accumulates in its shard; dp 1 has nothing to sync
        context = model.no_sync()
        return context

    # -- sharded checkpoints [Note: sharded canonical state] -----------------------------

    def stage_share(self, module: nn.Module, loading: bool) -> Share:
        """The tensors this rank writes (its stage's under pipelines) and
        where its tensor-parallel shards sit [Note: sharded canonical state]."""
        return self._share(module, loading)

    def every_stage_groups(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The param groups with every pipeline stage's parameter names."""
        return self._every_stage_groups(mine)

    def _share(self, module: nn.Module, loading: bool) -> Share:
        """What this rank writes: its stage's tensors (a weight tied across
        stages from the stage that trains it; every holder reads it back),
        its tensor-parallel shards placed in the full tensors."""
        names = None
        if self.pp_size > 1:
            assert self.stage.stage_params is not None, (
                "configure sets stage_params under pipelines"
            )
            me = self.layout.coord.pp
            params = {
                n for n in self.stage.stage_params if loading or self.stage.stage_of.get(n) == me
            }
            buffers = {n for n, b in module.named_buffers() if not (b.is_meta or is_lazy(b))}
            names = frozenset(params | buffers)
        if self.tp_size == 1:
            return Share(names)
        from pc_booster.plugins.tp_state import tp_share

        return tp_share(module, names)

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        boosted = self.boosted(model)
        if self.ep_size > 1:
            return hybrid_experts_state.sharded_model_state(self, boosted, loading)
        share = self._share(boosted.module, loading)
        if self.zero_stage:
            return zero_sharded_model_state(boosted.module, sharded(boosted.optimizer), share)
        return whole_state(boosted.module, share)

    def after_sharded_model_load(self, model: nn.Module) -> None:
        if self.ep_size > 1:
            hybrid_experts_state.after_sharded_model_load(self, self.boosted(model))
        elif self.zero_stage:
            sharded(self.boosted(model).optimizer).sync_params()

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        if self.ep_size > 1:
            return hybrid_experts_state.sharded_optimizer_state(
                self, self.boosted(optimizer), saved
            )
        module = self.boosted(optimizer).module
        share = self._share(module, loading=saved is not None)
        if self.zero_stage:
            out = zero_sharded_optimizer_state(module, sharded(optimizer), saved, share)
        else:
            out = own_optimizer_state(module, optimizer, saved, share)
        if self.pp_size > 1 and saved is None:
            out[GROUPS] = self._every_stage_groups(out[GROUPS])
        return out

    def _every_stage_groups(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The groups with every stage's parameter names (collective over
        the pipeline ranks; names only, a few bytes per parameter)."""
        stages: list[Any] = [None] * self.pp_size
        dist.all_gather_object(stages, mine, group=self.layout.pp_group)
        merged = []
        for index, group in enumerate(mine):
            names = [n for stage in stages for n in stage[index]["params"]]
            merged.append({**group, "params": list(dict.fromkeys(names))})
        return merged

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        module = self.boosted(optimizer).module
        if self.ep_size > 1:
            hybrid_experts_state.after_sharded_optimizer_load(self, self.boosted(optimizer), state)
        elif self.zero_stage:
            zero_after_sharded_optimizer_load(module, sharded(optimizer), state)
        else:
            after_own_optimizer_load(module, optimizer, state)

    # -- canonical state ---------------------------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.ep_size > 1:
            return hybrid_experts_state.model_state_dict(self, self.boosted(model))
        return hybrid_state.model_state_dict(self, model)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if self.ep_size > 1:
            hybrid_experts_state.load_model_state_dict(self, self.boosted(model), state)
            return
        hybrid_state.load_model_state_dict(self, model, state)

    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState:
        if self.ep_size > 1:
            return hybrid_experts_state.optimizer_state_dict(self, self.boosted(optimizer))
        return hybrid_state.optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None:
        if self.ep_size > 1:
            hybrid_experts_state.load_optimizer_state_dict(self, self.boosted(optimizer), state)
            return
        hybrid_state.load_optimizer_state_dict(self, optimizer, state)


# [Note: kernels and outputs of the hybrid plugin]
# What each option asks, with what torch has:
# - enable_flash_attention: the model's attention through torch's
#   scaled_dot_product_attention (transformers' "sdpa"), whose CUDA kernels
#   are FlashAttention's;
# - enable_fused_normalization: RMS norms through torch's fused rms_norm
#   (LayerNorm is one fused kernel in torch already);
# - parallel_output=False: a tensor-parallel model's logits gathered to the
#   full vocabulary after the forward (True keeps each rank's slice, which
#   is what the loss uses);
# - zero_bucket_size_in_m, cpu_offload: the ZeRO optimizer's bucket size
#   and host offload; ddp_bucket_cap_mb, find_unused_parameters,
#   gradient_as_bucket_view: pc-comm DDP's (zero_stage=0).
