"""Chunk-based ZeRO-3 (:class:`GeminiPlugin`) through ``pc_zero.GeminiDDP``
and ``GeminiOptimizer``; the canonical optimizer state is assembled per
parameter from each rank's part of its chunks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

import pc_offload
from pc_booster.canonical import (
    CanonicalOptimizerState,
    canonical_to_torch,
    names_by_id,
    optimizer_names,
    rebuild_optimizer,
    torch_groups,
    torch_to_canonical,
)
from pc_booster.plugin import Boosted, BoostRequest, Plugin, SupportsNoSync
from pc_booster.plugins.common import (
    cast_floating_inputs,
    device,
    full_logits,
    require_initialized,
    split_over_tp,
)
from pc_booster.plugins.gemini_options import GeminiOptions
from pc_booster.plugins.layout import ParallelLayout
from pc_booster.plugins.optimizations import apply_optimizations
from pc_booster.plugins.sharded import (
    GROUPS,
    SCALER,
    WHOLE,
    Share,
    apply_groups,
    groups_state,
    optim_key,
    restore_scalars,
    zero_model_state,
)
from pc_booster.plugins.tp_state import (
    shard_optimizer_state,
    shard_tensors,
    tp_share,
    unshard_optimizer_state,
    unshard_tensors,
)
from pc_booster.rules import TrainPrecision
from pc_booster.step_policies import GradientStep
from pc_booster.wrappers import inner_optimizer
from pc_zero import GeminiOptimizer

__all__ = ["GeminiOptions", "GeminiPlugin"]


def _chunk_search(model: nn.Module, o: GeminiOptions) -> tuple[int, int]:
    """The chunk-size search's bounds, in elements: the options' (32 M
    elements by default), but no more than 1/32 of the model or its
    largest parameter, whichever is larger. A step holds a few chunks whole
    at once (the gathered ones, their gradients, the prefetched next), so
    with a 32 M bound a model under a billion parameters would be
    gathered by large parts, or whole (measured on a 50 M-parameter GPT-2 at
    2 ranks: 565 MiB per rank with chunks of 1/8 of the model, 438 MiB with
    1/32; its whole fp32 model and Adam states are 579 MiB). Larger models
    keep 32 M-element chunks."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad] or [1]
    bound = max(sum(sizes) // 32, max(sizes), 1)
    return min(int(o.search_range_m * 2**20), bound), min(int(o.min_chunk_size_m * 2**20), bound)


def _own(optimizer: Optimizer | None) -> GeminiOptimizer:
    """The pc-zero optimizer this plugin boosted, behind the optimizer
    ``boost`` returned (TypeError for another)."""
    optimizer = inner_optimizer(optimizer)
    if not isinstance(optimizer, GeminiOptimizer):
        raise TypeError(f"expected GeminiPlugin's optimizer, got {type(optimizer).__name__}")
    return optimizer


_NO_CLIP = (
    "GeminiPlugin(step_in_backward=True) has stepped each chunk by the time backward "
    "returns, so there is nothing left to clip; clip with step_in_backward=False."
)


class GeminiPlugin(Plugin, SupportsNoSync):
    """Chunk-based ZeRO-3 (``pc_zero.GeminiDDP`` + ``GeminiOptimizer``):
    parameters packed into chunks in execution order, each chunk gathered
    once for every parameter in it (:class:`GeminiOptions`). A model built
    under ``LazyInitContext`` is materialised chunk by chunk, each rank
    keeping its shard. The optimizer is rebuilt over the shards with the
    same class, hyperparameters and param groups; use
    ``pc_offload.HybridAdam`` to step host-resident shards fast."""

    options: GeminiOptions

    takes_precision = True

    OPTIONS = GeminiOptions
    POSITIONAL = ("placement_policy",)

    def __init__(self, *args: Any, precision: str | None = None, **fields: Any) -> None:
        """``GeminiPlugin(placement_policy="static", ...)``: the fields of
        :class:`GeminiOptions` (or the options object), and ``precision=``
        [Note: options declared once]."""
        super().__init__(self.options_of(args, fields))
        self.set_precision(precision)

    # -- tensor parallelism (tp_size > 1): HybridParallelPlugin's groups ----------------

    _layout: ParallelLayout | None = None

    @property
    def layout(self) -> ParallelLayout:
        """The (dp, tp) groups, tp innermost, made when first needed."""
        if self._layout is None:
            self.validate_later(world=dist.get_world_size())
            self._layout = ParallelLayout.build(tp=self.options.tp_size)
        return self._layout

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return super().dp_group if self.options.tp_size == 1 else self.layout.dp_group

    @property
    def tp_size(self) -> int:
        return self.options.tp_size

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return None if self.options.tp_size == 1 else self.layout.tp_group

    def configure(self, request: BoostRequest) -> Boosted:
        from pc_zero import GeminiDDP, GeminiOptimizer

        model, optimizer, precision = request.model, request.optimizer, request.precision
        require_initialized("GeminiPlugin")
        o = self.options
        if optimizer is None and o.step_in_backward:
            raise ValueError(
                "GeminiPlugin(step_in_backward=True) steps the optimizer inside backward: pass "
                "one to boost(), or boost for inference with step_in_backward=False."
            )
        names = names_by_id(model)
        dtype = precision.dtype
        with torch.no_grad():  # frozen parameters stay whole on every rank, in the compute dtype
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(dtype)
        apply_optimizations(model, o)
        groups: dict[str, Any] = {}
        if o.tp_size > 1:  # pc-tensor's split, then chunks over the data-parallel ranks
            split_over_tp(model, self.layout.tp_group)
            groups = {"process_group": self.layout.dp_group}
        search_range, min_chunk_size = _chunk_search(model, o)
        if o.extra_dp_size > 1:  # two-level sharding ([Note: shards] in pc_chunk.chunk)
            self.validate_later(world=dist.get_world_size())
            from pc_comm import two_level_groups

            shard, replica = two_level_groups(o.extra_dp_size)
            groups = {"process_group": shard, "replica_process_group": replica}
        wrapped = GeminiDDP(
            model,
            device=device(),
            mixed_precision=dtype,
            sync_module_states=True,
            placement_policy="auto" if o.placement_policy == "auto" else "static",
            offload_param_frac=o.host_fraction(),
            device_budget_bytes=o.device_budget_bytes,
            chunk_size=o.chunk_size,
            search_range=search_range,
            min_chunk_size=min_chunk_size,
            prefetch=o.prefetch,
            step_in_backward=o.step_in_backward,
            pin_memory=o.pin_memory,
            hidden_dim=o.hidden_dim,
            **groups,
        )
        # Chunks hold trainable parameters only; frozen ones leave the optimizer.
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        zero = None  # boosted without an optimizer: inference (forward, state, saves)
        if optimizer is not None:
            inner = rebuild_optimizer(optimizer, names, trainable, skip_missing=True)
            narrow = pc_offload.parse_state_dtype(o.optimizer_states).value != "fp32"
            if narrow or o.nvme_offload_fraction:  # in place
                inner = pc_offload.adam_storing(
                    inner, o.optimizer_states, on_host=False, nvme_offload_fraction=
                    o.nvme_offload_fraction, nvme_offload_dir=o.nvme_offload_dir,
                )  # fmt: skip
            scale = o.loss_scale()
            zero = GeminiOptimizer(
                inner, wrapped, max_norm=o.max_norm, loss_scale=scale, tp_group=self.tp_group
            )
        if precision is not TrainPrecision.FP32:
            # The chunks compute in the run's dtype: so do the floating inputs
            # (an fp32 image batch) and buffers (BatchNorm's statistics).
            cast_floating_inputs(wrapped, dtype)
            # Also at each module holding parameters: a model may cast an
            # input to its parameters' dtype outside any forward (ViT's
            # patch embedding), where Gemini's are the fp32 shards.
            for module in model.modules():
                if any(True for _ in module.parameters(recurse=False)):
                    cast_floating_inputs(module, dtype)
            with torch.no_grad():
                for buffer in model.buffers():
                    if buffer.is_floating_point():
                        buffer.data = buffer.data.to(dtype)
        if o.tp_size > 1:  # the loss never gathers the vocabulary; the logits do
            model.register_forward_hook(full_logits)
        if o.force_outputs_fp32:
            wrapped.register_forward_hook(_outputs_fp32)
        if o.verbose and torch.distributed.get_rank() == 0:
            chunks: Any = wrapped.chunks
            host = sum(1 for c in chunks if not c.shard_on_device)
            print(
                f"pc: GeminiPlugin {precision.value}: {len(chunks)} chunks, {host} of them on "
                f"the host" + (", stepping in backward" if o.step_in_backward else ""),
                flush=True,
            )
        # The chunks' gradient shards are unscaled and clipped inside the step.
        policy = GradientStep("GeminiPlugin", no_clip=_NO_CLIP if o.step_in_backward else None)
        return request.boosted(wrapped, zero, module=model, step_policy=policy)

    def no_sync(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> AbstractContextManager[None]:
        # No rank holds a full gradient to accumulate locally: each backward
        # reduce-scatters into the gradient shard, where backwards add up.
        # Accumulation is correct inside or outside this context.
        self.validate_later(accumulation=2)
        return nullcontext()

    # -- canonical state: the model through summon, the optimizer per parameter ---------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}  # type: ignore[operator]
        if self.options.tp_size > 1:  # this rank's tensor-parallel pieces, gathered whole
            state = unshard_tensors(self.boosted(model).module, state)
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if self.options.tp_size > 1:
            state = shard_tensors(self.boosted(model).module, state, self._local_shapes(model))
        model.load_full_state_dict(state)  # type: ignore[operator]

    def _local_shapes(self, obj: Any) -> dict[str, torch.Size]:
        """Each chunked parameter's shape on this rank (its tensor-parallel piece)."""
        names = names_by_id(self.boosted(obj).module)
        wrapper: Any = self.boosted(obj).model
        return {names[id(s.param)]: s.shape for chunk in wrapper.chunks for s in chunk.slots}

    def _share(self, obj: Any) -> Share:
        """Where this rank's tensors sit in the canonical state (tensor-parallel pieces)."""
        return tp_share(self.boosted(obj).module) if self.options.tp_size > 1 else WHOLE

    def _parts(
        self, optimizer: Optimizer
    ) -> Iterator[tuple[str, nn.Parameter, int, int, torch.Size]]:
        boosted = self.boosted(optimizer)
        names = names_by_id(boosted.module)
        wrapper: Any = boosted.model
        for chunk in wrapper.chunks:
            for slot, (param, start, part) in zip(chunk.slots, chunk.shard_parts(), strict=True):
                yield names[id(param)], param, start, part.numel(), slot.shape

    def optimizer_state_dict(self, optimizer: Optimizer) -> CanonicalOptimizerState:
        inner = _own(optimizer).inner
        names = names_by_id(self.boosted(optimizer).module)
        groups = {"state": {}, "param_groups": inner.state_dict()["param_groups"]}
        saved = torch_to_canonical(groups, optimizer_names(inner, names))  # groups by name
        parts = list(self._parts(optimizer))
        wrapper: Any = self.boosted(optimizer).model
        # Which keys each parameter has, and its scalars ("step"), agreed
        # first: a rank whose part is empty may hold no state at all, and
        # every rank must make the same collectives.
        mine = {
            name: {
                k: "tensor" if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in inner.state.get(param, {}).items()
            }
            for name, param, *_ in parts
        }
        everyone: list[Any] = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(everyone, mine, group=self.dp_group)
        state: dict[str, dict[str, Any]] = {}
        for name, param, start, numel, shape in parts:
            keys: dict[str, Any] = {}
            for other in everyone:
                for k, v in other[name].items():
                    keys.setdefault(k, v)
            entry = inner.state.get(param, {})
            full_entry: dict[str, Any] = {}
            for key in sorted(keys):
                if keys[key] != "tensor":
                    value = keys[key]
                    full_entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                full = torch.zeros(shape.numel(), dtype=torch.float32, device=param.device)
                if key in entry:
                    full[start : start + numel] = entry[key].float()
                wrapper.comm.all_reduce(full)
                full_entry[key] = full.view(shape).cpu()
            state[name] = full_entry
        scaler = _own(optimizer).scaler
        canonical: CanonicalOptimizerState = {
            "state": state,
            "param_groups": saved["param_groups"],
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
        }
        if self.options.tp_size > 1:
            canonical = unshard_optimizer_state(self.boosted(optimizer).module, canonical)
        return canonical

    # -- sharded checkpoints: each rank's part of every chunk -----------------------------

    def sharded_model_state(self, model: nn.Module, loading: bool = False) -> dict[str, Any]:
        names = names_by_id(self.boosted(model).module)
        shapes = self._local_shapes(model)
        pieces = [(names[id(p)], start, part) for p, start, part, _ in self._my_parts(model)]
        return zero_model_state(self.boosted(model).module, shapes, pieces, self._share(model))

    def _my_parts(self, obj: Any) -> list[tuple[nn.Parameter, int, torch.Tensor, torch.Size]]:
        wrapper: Any = self.boosted(obj).model
        return [
            (param, start, part, slot.shape)
            for chunk in wrapper.chunks
            for slot, (param, start, part) in zip(chunk.slots, chunk.shard_parts(), strict=True)
            if part.numel()
        ]

    def sharded_optimizer_state(
        self, optimizer: Optimizer, saved: dict[str, dict[str, bool]] | None
    ) -> dict[str, Any]:
        inner = _own(optimizer).inner
        names = names_by_id(self.boosted(optimizer).module)
        share = self._share(optimizer)
        out: dict[str, Any] = {}
        for param, start, part, shape in self._my_parts(optimizer):
            name = names[id(param)]
            entry = inner.state[param]
            for key, value in list(entry.items()):  # narrow moments: pieces of fp32 copies
                if isinstance(value, torch.Tensor) and pc_offload.is_narrow(value):
                    entry[key] = pc_offload.widen(value)  # narrow again at the next step
            for key, elementwise in (saved or {}).get(name, {}).items():
                if key not in entry:
                    entry[key] = (
                        torch.zeros_like(part, dtype=torch.float32)
                        if elementwise
                        else torch.zeros((), dtype=torch.float32)
                    )
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == part.shape:
                    target = share.pieces(name, shape)
                    share.add_range(target, name, shape, start, value)
                    out[optim_key(name, key)] = target
                else:
                    out[optim_key(name, key)] = torch.as_tensor(value, dtype=torch.float32).clone()
        out[GROUPS] = groups_state(inner, names)
        scaler = _own(optimizer).scaler
        if scaler is not None:
            out[SCALER] = scaler.state_dict()
        return out

    def after_sharded_optimizer_load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        inner = _own(optimizer).inner
        names = names_by_id(self.boosted(optimizer).module)
        for param, *_ in self._my_parts(optimizer):
            restore_scalars(inner.state[param], state, names[id(param)])
        apply_groups(inner, names, state.get(GROUPS))
        scaler = _own(optimizer).scaler
        if scaler is not None and isinstance(state.get(SCALER), dict):
            scaler.load_state_dict(state[SCALER])

    def load_optimizer_state_dict(
        self, optimizer: Optimizer, state: CanonicalOptimizerState
    ) -> None:
        inner = _own(optimizer).inner
        names = names_by_id(self.boosted(optimizer).module)
        if self.options.tp_size > 1:
            module = self.boosted(optimizer).module
            state = shard_optimizer_state(module, state, self._local_shapes(optimizer))
        converted = canonical_to_torch(
            {"state": {}, "param_groups": state["param_groups"]},
            optimizer_names(inner, names),
            torch_groups(inner),
        )
        inner.load_state_dict(converted)  # hyperparameters
        scaler = _own(optimizer).scaler
        if scaler is not None and state.get("loss_scaler") is not None:
            scaler.load_state_dict(state["loss_scaler"])
        # torch swapped the group objects: re-alias them on the wrapper.
        optimizer.param_groups, optimizer.state = inner.param_groups, inner.state
        for name, param, start, numel, _ in self._parts(optimizer):
            entry = state["state"].get(name)
            if entry is None:
                continue
            local: dict[str, Any] = {}
            for key, value in entry.items():
                if key == "master":
                    continue
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    part = value.reshape(-1)[start : start + numel]
                    local[key] = part.to(param.device, torch.float32).clone()
                else:
                    local[key] = value.clone() if isinstance(value, torch.Tensor) else value
            inner.state[param] = local


def _outputs_fp32(module: nn.Module, args: Any, output: Any) -> Any:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float()
        return value

    if isinstance(output, torch.Tensor):
        return cast(output)
    if isinstance(output, dict):  # transformers' ModelOutput is a dict
        for key in list(output.keys()):
            output[key] = cast(output[key])
        return output
    if isinstance(output, tuple):
        return type(output)(cast(v) for v in output)
    return output
