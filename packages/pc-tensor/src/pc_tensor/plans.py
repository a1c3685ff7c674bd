"""A :class:`~pc_tensor.policies.Policy` read from the tensor-parallel plan
that ``transformers`` ships with a model family (``config.base_model_tp_plan``,
about 150 families in transformers 5): any model whose family has one can
be sharded without a hand-written policy.

What a plan says, and what pc does with it (keys are module paths relative
to the base model, ``*`` standing for each block of the block list):

==============================  ============================================
plan style                      pc
==============================  ============================================
``colwise``                     :class:`ColumnParallelLinear`, output split
``rowwise``                     :class:`RowParallelLinear`, input already split
``colwise_gather_output``       column-parallel, the output gathered
``rowwise_split_input``         row-parallel, splitting its whole input
``replicated_with_grad_allreduce``  whole on every rank, gradient summed
                                over the group (a norm over local heads)
``embedding_rowwise``,          the token embedding: pc always splits it by
``replicate`` (embedding)       vocabulary (:class:`VocabParallelEmbedding`)
``moe_*`` and expert keys       refused, naming the block: no expert
                                parallelism yet
``packed_*``, ``mla_kv_a_proj``,  refused with the style's name
``local_params``, ``all_reduce``,
``embedding_colwise``
==============================  ============================================

The output layer: a ``...ForCausalLM`` or ``...ForMaskedLM`` model's
vocabulary projection (``get_output_embeddings()``) is split by vocabulary
with a loss that never gathers the logits, tied to the embedding where the
model ties them. Other heads (sequence or token classification) stay whole
on every rank: their input is the same everywhere.

Attention modules in transformers 5 reshape by ``-1`` heads, so a
column-split projection needs no change to the module's attributes; grouped-
query attention keeps its ratio of query to key/value heads. The config's
head counts must divide by the tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from pc_tensor.policies import POLICIES, Policy

__all__ = ["has_plan", "plan_policy", "policy_for"]

_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
_REFUSED = {
    "packed_colwise": "a packed projection split in parts of the plan's own layout",
    "packed_rowwise": "a packed projection split in parts of the plan's own layout",
    "mla_kv_a_proj": "multi-head latent attention's shared key/value projection",
    "local_params": "an attention module's per-head parameters (sinks)",
    "all_reduce": "a module whose output is summed over the group",
    "embedding_colwise": "an embedding split by features inside a block",
}


# Families whose plan pc follows but whose tensor-parallel training the plan
# sweep (integration_tests/plans) measured away from single-process
# training: refused until the cause is found, never trained wrong.
_DIFFERS = {
    "gemma4_unified_text": (
        "pc's plan sweep measured its tensor-parallel training away from single-process "
        "training (1.5e-6 in float64 after 3 steps, where the families that pass agree to "
        "rounding); the cause is not found yet"
    ),
    "neomme": (
        "its attention computes over every head in modules its tensor-parallel plan does not "
        "name (an exclusive-attention step, a gated output projection), so the split "
        "projections do not fit them"
    ),
}


def _plan(config: Any) -> Mapping[str, str] | None:
    plan = getattr(config, "base_model_tp_plan", None)
    return plan if isinstance(plan, Mapping) and plan else None


def has_plan(model: nn.Module) -> bool:
    """Whether ``model``'s config carries a tensor-parallel plan."""
    return _plan(getattr(model, "config", None)) is not None


def _path_of(root: nn.Module, target: object) -> str | None:
    if target is None:
        return None
    for name, module in root.named_modules():
        if module is target:
            return str(name)
    return None


def _field(config: Any, name: str) -> Any:
    """``config.<name>``, or None where it is missing or only per layer
    (transformers raises for a global read of a per-layer field)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _ask(model: nn.Module, method: str) -> Any:
    """``model.<method>()`` (transformers' get_input/output_embeddings), or
    None where the model has no such method."""
    found: Any = getattr(model, method, None)
    return found() if callable(found) else None


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _is_expert_key(key: str, style: str) -> bool:
    return style.startswith("moe") or ".experts" in f".{key}" or key.endswith("experts")


# Why pc refuses mixture-of-experts blocks under tensor parallelism, and what to do.
_NO_EXPERT_TP = (
    "pc has no tensor parallelism of experts, so it refuses it. Split the experts by expert "
    "parallelism (HybridParallelPlugin(ep_size=...), which shards the rest with tp_size), or "
    "train it with data parallelism, ZeRO or a pipeline (pp_size)."
)


def _refuse_plan(
    plan: Mapping[str, str] | None, kind: Any, label: str, skip_experts: bool = False
) -> Mapping[str, str]:
    """``plan``, where pc follows it as a whole: errors for no plan, a
    family pc refuses, mixture-of-experts blocks (``skip_experts``: their
    entries left out, the experts kept whole for expert parallelism)."""
    if plan is None:
        raise ValueError(
            f"{label} has no tensor-parallel plan in its config "
            "(config.base_model_tp_plan) and no pc policy: describe it with pc_tensor.Policy."
        )
    if kind in _DIFFERS:
        raise ValueError(f"{label}: {_DIFFERS[kind]}.")
    if skip_experts:
        return {k: v for k, v in plan.items() if not _is_expert_key(k, v)}
    for key, style in plan.items():
        if _is_expert_key(key, style):
            block = key.split(".experts")[0] if ".experts" in key else key
            raise ValueError(
                f"{label} has mixture-of-experts blocks "
                f"({block!r}: {key!r} is {style!r} in its tensor-parallel plan); "
                f"{_NO_EXPERT_TP}"
            )
    return plan


def _refuse_experts(base: nn.Module, label: str) -> None:
    """Mixture-of-experts blocks are refused by what the model holds, not
    only by its plan: transformers 5.2x plans name no experts for some
    families (Mixtral's names attention alone), which would leave every
    expert whole on every tensor-parallel rank without a word."""
    for name, module in base.named_modules():
        if name.rpartition(".")[2] == "experts" or type(module).__name__.endswith("Experts"):
            block = ".".join("*" if part.isdigit() else part for part in name.split(".")[:-1])
            raise ValueError(
                f"{label} has mixture-of-experts blocks ({block!r}: {name!r} is "
                f"{type(module).__name__}); {_NO_EXPERT_TP}"
            )


def _in_some_block(base: nn.Module, plan: Mapping[str, str]) -> Mapping[str, str]:
    """The plan's block entries that name a module in at least one block
    (Qwen2-MoE's plan also names the dense MLP of layers it builds without
    experts; a model whose layers all hold experts has none)."""
    kept = {}
    for key, style in plan.items():
        prefix, _, inner = key.partition(".*.")
        blocks = _get(base, prefix) if inner else None
        if isinstance(blocks, nn.ModuleList) and not any(
            _get(block, inner) is not None for block in blocks
        ):
            continue
        kept[key] = style
    return kept


@dataclass
class _Blocks:
    """What a plan says about its block list: the list's path, and the
    layers inside a block (paths relative to it) by what is done to them."""

    path: str | None = None
    column: dict[str, int] = field(default_factory=dict)
    row: list[str] = field(default_factory=list)
    gather_output: list[str] = field(default_factory=list)
    split_input: list[str] = field(default_factory=list)
    grad_sum: list[str] = field(default_factory=list)

    def add(self, key: str, style: str, label: str) -> None:
        """The plan's ``key`` (``<blocks>.*.<inner>``) sharded as ``style``."""
        prefix, _, inner = key.partition(".*.")
        if "*" in inner:
            raise ValueError(
                f"{label}: plan key {key!r} nests a second list inside a "
                "block, which pc does not implement."
            )
        if self.path is not None and prefix != self.path:
            raise ValueError(
                f"{label}: its plan names two block lists, {self.path!r} and "
                f"{prefix!r}; pc shards one."
            )
        self.path = prefix
        if style in ("colwise", "colwise_gather_output"):
            self.column[inner] = 1
            if style == "colwise_gather_output":
                self.gather_output.append(inner)
        elif style in ("rowwise", "rowwise_split_input"):
            self.row.append(inner)
            if style == "rowwise_split_input":
                self.split_input.append(inner)
        elif style == "replicated_with_grad_allreduce":
            self.grad_sum.append(inner)
        elif style != "replicate":
            raise ValueError(f"{label}: plan style {style!r} (key {key!r}) is not one pc knows.")


def _read_plan(plan: Mapping[str, str], embedding: str | None, label: str) -> _Blocks:
    """The plan's keys read: inside the block list, what each layer's style
    asks; outside it, only the token embedding and what stays replicated.
    Refused with the reason where pc cannot follow them."""
    blocks = _Blocks()
    for key, style in plan.items():
        if style in _REFUSED:
            raise ValueError(
                f"{label}: its tensor-parallel plan shards {key!r} as "
                f"{style!r} ({_REFUSED[style]}), which pc does not implement yet."
            )
        if ".*." not in key:
            if key == embedding and style in ("embedding_rowwise", "replicate", "rowwise"):
                continue  # pc splits the token embedding by vocabulary in any case
            if style in ("replicate", "replicated_with_grad_allreduce"):
                continue
            raise ValueError(
                f"{label}: its tensor-parallel plan shards {key!r} "
                f"({style!r}) outside the block list, which pc does not implement."
            )
        blocks.add(key, style, label)
    return blocks


def _check_blocks(
    base: nn.Module, plan: Mapping[str, str], blocks: _Blocks, embedding: str | None, label: str
) -> str:
    """The block list's path, where the plan splits something inside blocks
    that all hold what it names, and the model has a token embedding."""
    if blocks.path is None:
        raise ValueError(
            f"{label}: its tensor-parallel plan splits only "
            f"{', '.join(plan)}, nothing inside its blocks, so tensor parallelism would save "
            "nothing; train it with data parallelism, ZeRO or a pipeline."
        )
    if embedding is None:
        raise ValueError(
            f"{label}: pc finds no token embedding (get_input_embeddings) to split by vocabulary."
        )
    missing = [
        f"{blocks.path}.{i}.{path}"
        for i, block in enumerate(_get(base, blocks.path))
        for path in (*blocks.column, *blocks.row, *blocks.grad_sum)
        if _get(block, path) is None
    ]
    if missing:
        raise ValueError(
            f"{label}: its blocks differ in kind (hybrid attention), and "
            f"{missing[0]} named by its tensor-parallel plan does not exist; pc shards blocks "
            "of one kind."
        )
    return blocks.path


def _add_partial_grads(base: nn.Module, where: str, blocks: _Blocks) -> None:
    """Inside a module whose column layers keep their outputs split (an MLP,
    an attention module), what else holds parameters works on this rank's
    features or heads (a learned activation, a per-head norm): its
    gradient is partial, as for the plan's replicated_with_grad_allreduce."""
    column, row, grad_sum = blocks.column, blocks.row, blocks.grad_sum
    gathered = set(blocks.gather_output)
    for parent in {path.rpartition(".")[0] for path in column if path not in gathered}:
        if not parent:
            continue
        for block in _get(base, where):
            module = _get(block, parent)
            for child, sub in module.named_modules():
                inner = f"{parent}.{child}" if child else parent
                if inner in column or inner in row or inner in grad_sum or not child:
                    continue
                if any(True for _ in sub.parameters(recurse=False)):
                    grad_sum.append(inner)
            break


def _output_layer(model: nn.Module, name: str) -> tuple[dict[str, str], Any]:
    """The vocabulary projection of a ``...ForCausalLM`` or
    ``...ForMaskedLM`` model (class name -> path) and the loss it takes."""
    lm_heads: dict[str, str] = {}
    loss: Any = "causal"
    if name.endswith(("ForCausalLM", "ForMaskedLM")):
        output = _ask(model, "get_output_embeddings")
        head_path = _path_of(model, output)
        if head_path is not None and type(output) is nn.Linear:
            lm_heads[name] = head_path
            loss = "causal" if name.endswith("ForCausalLM") else "masked"
    return lm_heads, loss


def plan_policy(model: nn.Module, skip_experts: bool = False) -> Policy:
    """The :class:`Policy` that ``model``'s ``config.base_model_tp_plan``
    describes (see the module docstring). Raises ``ValueError`` naming the
    key and the reason for a plan pc cannot follow (mixture-of-experts
    blocks, styles it does not implement). ``skip_experts``: the plan's
    expert entries left out, the experts kept whole on every tensor-
    parallel rank (expert parallelism splits them, ``shard_experts``)."""
    config: Any = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    name = type(model).__name__
    label = f"{name} (model_type={kind!r})"
    plan = _refuse_plan(_plan(config), kind, label, skip_experts)
    base: nn.Module = getattr(model, "base_model", model)
    if not skip_experts:
        _refuse_experts(base, label)
    if skip_experts:
        plan = _in_some_block(base, plan)
    embedding = _path_of(base, _ask(base, "get_input_embeddings"))
    blocks = _read_plan(plan, embedding, label)
    path = _check_blocks(base, plan, blocks, embedding, label)
    assert embedding is not None  # _check_blocks refuses a model without one
    _add_partial_grads(base, path, blocks)
    # Under sequence parallelism the input of the modules holding column
    # layers is gathered once on entry (attention reads the sequence whole).
    parents = {inner.rpartition(".")[0] for inner in blocks.column}
    lm_heads, loss = _output_layer(model, name)
    return Policy(
        name=f"{kind} (transformers plan)",
        blocks=path,
        embedding=embedding,
        column=blocks.column,
        row=tuple(blocks.row),
        heads={},
        head_counts=tuple(c for c in _HEAD_COUNTS if isinstance(_field(config, c), int)),
        gather_at=tuple(sorted(p for p in parents if p)),
        lm_heads=lm_heads,
        loss=loss,
        gather_output=tuple(blocks.gather_output),
        split_input=tuple(blocks.split_input),
        grad_sum=tuple(blocks.grad_sum),
    )


def policy_for(model: nn.Module) -> Policy:
    """The policy :func:`~pc_tensor.shard_model` uses by default: the
    family's transformers plan where it has one, else pc's hand-written
    policy for the families without (GPT-2, BERT, OPT, Bloom)."""
    if has_plan(model):
        return plan_policy(model)
    kind = getattr(getattr(model, "config", None), "model_type", None) or ""
    policy = POLICIES.get(kind)
    if policy is None:
        raise ValueError(
            f"shard_model has no tensor-parallel policy for {type(model).__name__} "
            f"(model_type={kind!r}): its config has no base_model_tp_plan and pc has no "
            f"hand-written policy for it (those cover {', '.join(sorted(POLICIES))}). "
            "Describe it with pc_tensor.Policy (the block list, the column- and row-parallel "
            "projections inside a block) and pass shard_model(model, group, policy=...); "
            "docs/packages/pc-tensor.md shows one."
        )
    return policy
