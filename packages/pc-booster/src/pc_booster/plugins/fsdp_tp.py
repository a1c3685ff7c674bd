"""Tensor parallelism under FSDP2 (``TorchFSDPPlugin(tp_size=...)``): the
model's own tensor-parallel plan applied with torch's DTensor styles,
then every unit sharded over the data-parallel ranks.

[Note: FSDP2 over tensor parallelism]
As torchtitan trains its largest models: the ranks form a 2-D mesh
``(dp, tp)``, tp innermost (consecutive ranks: a node's fast links carry
the per-layer collectives). ``config.base_model_tp_plan`` (transformers 5
ships one with about 150 families) names each block's projections:
``colwise`` becomes torch's ``ColwiseParallel`` (the weight split by
output features, the output left split), ``rowwise`` ``RowwiseParallel``
(split by input features, the partial outputs summed over tp),
``colwise_gather_output`` / ``rowwise_split_input`` their gathering and
splitting variants. The parameters become DTensors on the tp mesh, and
``fully_shard(mesh=dp)`` then shards them again over dp (2-D DTensors);
every other parameter (embeddings, norms, the output layer) is whole on
each tp rank and sharded over dp only. Attention reshapes by ``-1`` heads,
so a column-split projection gives each rank its own heads; the config's
head counts must divide by tp. The loss, checkpoints (DTensors keep the
global shapes: a checkpoint loads under any layout) and clipping (norms
per mesh, combined: ``pc_booster.clipping``) need nothing else.
Styles whose parameters would need their gradients summed over tp
(``replicated_with_grad_allreduce``), experts and packed projections are
refused: HybridParallelPlugin's tensor parallelism handles them.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["apply_tensor_parallel", "tensor_parallel_plan"]

_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return styles.get(name)


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key (``layers.*.self_attn.q_proj``) as a module-path pattern."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def tensor_parallel_plan(model: nn.Module, tp: int) -> dict[nn.Module, str]:
    """Each module the model's plan splits, with its style's name; a
    ValueError naming what cannot be split (no plan, a style this path
    does not take, head counts not dividing ``tp``)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"TorchFSDPPlugin(tp_size={tp}) splits a model by its config's base_model_tp_plan "
            f"(a transformers model); {type(model).__name__} has none. Use "
            "HybridParallelPlugin(tp_size=...), which also infers a plan, or tp_size=1."
        )
    for attribute in _HEAD_COUNTS:
        count = getattr(config, attribute, None)
        if isinstance(count, int) and count % tp:
            raise ValueError(
                f"TorchFSDPPlugin(tp_size={tp}): the config's {attribute}={count} does not "
                f"divide by {tp}; each rank computes whole heads. Pick a tp_size dividing it."
            )
    base = getattr(model, "base_model", model)
    prefix = next((n + "." for n, m in model.named_modules() if m is base and n), "")
    found: dict[nn.Module, str] = {}
    for key, style in plan.items():
        pattern = _pattern(key)
        matched = [(n, m) for n, m in base.named_modules() if n and pattern.match(n)]
        if not matched:
            continue
        if _style(style) is None:
            raise ValueError(
                f"TorchFSDPPlugin(tp_size={tp}): the plan splits {prefix}{key} as {style!r}, "
                "which FSDP2 over torch's tensor-parallel styles does not take (colwise, "
                "rowwise, colwise_gather_output, rowwise_split_input). "
                "HybridParallelPlugin(tp_size=...) splits it."
            )
        for name, module in matched:
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"TorchFSDPPlugin(tp_size={tp}): {prefix}{name} is a "
                    f"{type(module).__name__}, not a Linear; the plan's {style!r} split is "
                    "HybridParallelPlugin's here."
                )
            found[module] = style
    if not found:
        raise ValueError(
            f"TorchFSDPPlugin(tp_size={tp}): no module of {type(model).__name__} matches its "
            f"base_model_tp_plan ({sorted(plan)[:3]}...); use HybridParallelPlugin(tp_size=...)."
        )
    return found


def apply_tensor_parallel(modules: dict[nn.Module, str], within: nn.Module, tp_mesh: Any) -> None:
    """Split the planned modules inside ``within`` (and drop them from
    ``modules``) [Note: FSDP2 over tensor parallelism]."""
    from torch.distributed.tensor.parallel import parallelize_module

    inside = {id(m) for m in within.modules()}
    for module in [m for m in modules if id(m) in inside]:
        parallelize_module(module, tp_mesh, _style(modules.pop(module))())
