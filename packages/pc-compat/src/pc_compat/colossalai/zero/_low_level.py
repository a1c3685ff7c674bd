"""``colossalai.zero.LowLevelZeroOptimizer`` over pc-zero's ZeRO-1/2
optimizer, with Colossal-AI's parameters and defaults: ``partition_grad``
is stage 2, the loss-scale arguments are pc-zero's LossScaleConfig (used for
fp16 parameters, as Colossal-AI's), ``clip_grad_norm`` the global-norm
clip, ``forced_dtype`` casts the parameters first, and ``backward_context``
wraps ``optimizer.backward``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from pc_compat.colossalai.zero._edges import (
    LOSS_SCALE_FIELDS,
    EdgeTranslation,
    TranslatedEdge,
    install,
    loss_scale_config,
    refuse_unless,
    taken_by_edge,
)
from pc_zero import low_level_zero as _pc

__all__ = ["LowLevelZeroOptimizer"]

_NAME = "LowLevelZeroOptimizer"


def _stage(partition_grad: bool) -> dict[str, Any]:
    return {"stage": 2 if partition_grad else 1}


def _max_norm(clip_grad_norm: float) -> dict[str, Any]:
    """Colossal-AI's ``clip_grad_norm``: pc-zero's ``max_norm``."""
    return {"max_norm": clip_grad_norm}


class LowLevelZeroOptimizer(TranslatedEdge, _pc.LowLevelZeroOptimizer):
    """Colossal-AI's ``LowLevelZeroOptimizer(optimizer, ...)``: ZeRO stage 1
    (stage 2 with ``partition_grad=True``) over the data-parallel group
    ([Note: a step] in pc_zero.low_level_zero). pc's own options
    (``comm``, ``tp_process_group``, ``model_parallel_groups``,
    ``counts_toward_norm``) are keywords after the original's arguments.
    Call ``optimizer.backward(loss)``, then ``step()`` and ``zero_grad()``."""

    CORE = _pc.LowLevelZeroOptimizer
    TRANSLATION = EdgeTranslation(
        "colossalai.zero",
        _NAME,
        no_effect={
            "verbose": "the original logs overflows; pc computes the same and prints nothing",
            "overlap_allgather": (
                "whether the original overlaps its parameter all-gather with the next forward; "
                "pc gathers after the step, and the values computed are the same"
            ),
        },
        handled={
            **dict.fromkeys(LOSS_SCALE_FIELDS, taken_by_edge),
            "pg_to_param_list": taken_by_edge,
            "communication_dtype": taken_by_edge,
            "forced_dtype": taken_by_edge,
            "master_weights": taken_by_edge,
            "backward_context": taken_by_edge,
            "partition_grad": _stage,
            "clip_grad_norm": _max_norm,
            "extra_dp_group": refuse_unless(
                _NAME,
                "extra_dp_group",
                None,
                "pc shards ZeRO over one data-parallel group (dp_process_group=), with no "
                "second level; leave it None.",
            ),
            "fp8_communication": refuse_unless(
                _NAME,
                "fp8_communication",
                False,
                "pc reduces gradients in the parameters' dtype (no fp8 path); leave it False.",
            ),
        },
        fills=frozenset({"stage", "loss_scale", "max_norm"}),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        edge = LowLevelZeroOptimizer
        values = edge.TRANSLATION.arguments(edge.CORE, args, kwargs)
        pc = edge.TRANSLATION.to_pc(edge.CORE, args, kwargs)
        params = [p for g in values["optimizer"].param_groups for p in g["params"]]
        forced = values["forced_dtype"]
        if forced is not None:  # as Colossal-AI does: the parameters themselves are cast
            for param in params:
                param.data = param.data.to(forced)
        dtype = next((p.dtype for p in params if p.requires_grad), torch.float32)
        _check_dtypes(dtype, values["communication_dtype"], values["master_weights"])
        group = _group_of(values["pg_to_param_list"], params, values["dp_process_group"])
        if group is not None:
            pc["dp_process_group"] = group
        pc["loss_scale"] = loss_scale_config(values)
        super().__init__(**pc)
        # Called for a context manager that wraps each backward (Colossal-AI's hook).
        self.backward_context: Callable[[], AbstractContextManager[Any]] | None = values[
            "backward_context"
        ]

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        context = self.backward_context() if self.backward_context is not None else nullcontext()
        with context:
            super().backward(loss, retain_graph)


def _check_dtypes(dtype: torch.dtype, communication: torch.dtype | None, masters: bool) -> None:
    if communication is not None and communication != dtype:
        raise ValueError(
            f"{_NAME}(communication_dtype={communication}): pc reduces gradients in the "
            f"parameters' dtype ({dtype}); leave it None, or cast the parameters "
            "(forced_dtype=)."
        )
    if not masters and dtype != torch.float32:
        raise ValueError(
            f"{_NAME}(master_weights=False): pc keeps fp32 masters of each rank's shard of "
            f"{dtype} parameters (a 16-bit update in place loses small steps); leave it True."
        )


def _group_of(
    groups: Any, params: list[torch.Tensor], dp_process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The one data-parallel group of ``pg_to_param_list`` (None: not given)."""
    if groups is None:
        return None
    if dp_process_group is not None:
        raise ValueError(
            f"{_NAME}: pass dp_process_group or pg_to_param_list, not both (as Colossal-AI)."
        )
    items = list(groups.items()) if isinstance(groups, Mapping) else []
    if len(items) == 1:
        group, listed = items[0]
        if isinstance(group, dist.ProcessGroup) and {id(p) for p in listed} == {
            id(p) for p in params
        }:
            return group
    raise ValueError(
        f"{_NAME}(pg_to_param_list=...): pc shards every parameter over one data-parallel "
        "group, so this takes {group: all of the optimizer's parameters}; parameters spread "
        "over several groups (MoE experts) are not supported. Pass dp_process_group=group."
    )


install(LowLevelZeroOptimizer)
