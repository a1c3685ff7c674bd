"""Cutting a ``transformers`` model into pipeline layers
(:func:`pipeline_layers`) from its ``base_model_pp_plan``, pc's own lists
(GPT-2, BERT), or its module tree (the repeated blocks)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pc_booster.pipeline.stages import (
    SequenceShare,
    _BertEmbed,
    _Block,
    _GPT2Embed,
    _Head,
    _needs_causal_mask,
    _PlanBlock,
    _PlanContext,
    _PlanEmbed,
    _PlanHead,
    router_recorder,
)

__all__ = ["pipeline_layers"]

# the heads pc cuts, by the end of the model class name
_HEADS = {
    "ForCausalLM": "causal",
    "LMHeadModel": "causal",
    "ForMaskedLM": "masked",
    "ForSequenceClassification": "sequence",
    "ForTokenClassification": "token",
    "ForImageClassification": "pooled",
}


def _context(
    model: nn.Module,
    base: nn.Module,
    blocks: nn.ModuleList,
    share: SequenceShare | None,
    kind: str,
) -> _PlanContext:
    """What the layers share; a causal mixture-of-experts model's routers
    recorded for its auxiliary loss [Note: router logits through a pipeline]."""
    context = _PlanContext(model, base, blocks, share)
    spec = router_recorder(model) if kind == "causal" else None
    if spec is not None:
        context.record_routers(spec)
    return context


def _plan_layers(
    model: nn.Module, plan: dict[str, Any], kind: str, share: SequenceShare | None = None
) -> list[nn.Module]:
    """The layers of a model whose config has a ``base_model_pp_plan``: its
    keys name the base model's modules in order, one of them the block list."""
    base: nn.Module = getattr(model, "base_model", model)
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"pipeline parallelism: {type(model).__name__}'s base_model_pp_plan {names} names "
            f"{len(lists)} block lists; pc cuts a model with one."
        )
    blocks: nn.ModuleList = getattr(base, lists[0])
    if len(blocks) < 2:
        raise ValueError(
            f"pipeline parallelism needs 2 or more blocks; {type(model).__name__} has "
            f"{len(blocks)}."
        )
    after = set(names[names.index(lists[0]) + 1 :])
    shared = {n: m for n, m in base.named_children()
              if m is not blocks and not any(True for _ in m.parameters())}  # fmt: skip
    before = {n: m for n, m in base.named_children()
              if m is not blocks and n not in after and n not in shared}  # fmt: skip
    post = {n: getattr(base, n) for n in names if n in after}
    heads = {n: m for n, m in model.named_children() if m is not base}
    if model is base:
        raise ValueError(
            f"pipeline parallelism: {type(model).__name__} is a base model without a head; "
            "give it one (ForCausalLM, ForSequenceClassification, ...)."
        )
    context = _context(model, base, blocks, share, kind)
    first = _PlanEmbed(context, {**before, **shared})
    middle = [_PlanBlock(context, i, b, shared) for i, b in enumerate(blocks)]
    pooled = kind == "sequence"
    if pooled:
        last = _PlanHead(context, {**post, **heads}, pooled=True)
    else:
        # The model's forward runs on this stage too; what it computes before
        # the blocks is discarded, and the token embedding is not read.
        find: Any = getattr(base, "get_input_embeddings", None)
        embedding = find() if callable(find) else None
        kept = {n: m for n, m in before.items() if m is not embedding}
        last = _PlanHead(context, {**kept, **shared, **post, **heads}, pooled=False)
    return [first, *middle, last]


# [Note: a cut inferred from the module tree]
# A family without a base_model_pp_plan is cut the same way, from its
# module tree: the block list is the base model's one nn.ModuleList (at any
# depth) of two or more blocks of one class; everything else in the base
# model (embeddings, position embeddings, projections, final norms) goes to
# the first stage, which runs the base model's forward up to the first
# block, and, but for the token embedding, to the last stage, which runs the
# model's forward after the last block. A module one of them does not use
# (the final norm on the first stage) gets no gradient there; the stages
# holding a module are tied, their gradients summed, so its copies stay
# equal. A model whose base forward takes no inputs_embeds (the blocks'
# arguments are recorded through it) or whose blocks are not found this
# way is refused.


def _block_list(base: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The base model's one list of repeated blocks, by dotted name."""
    found = [
        (name, module)
        for name, module in base.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) >= 2
        and len({type(block) for block in module}) == 1
    ]
    return found[0] if len(found) == 1 else None


def _outside(base: nn.Module, path: str) -> dict[str, nn.Module]:
    """The largest submodules of ``base`` that neither are nor hold the
    module at ``path``, keyed by dotted name with the dots as underscores."""
    out: dict[str, nn.Module] = {}
    holder, prefix = base, ""
    for part in path.split("."):
        for name, child in holder.named_children():
            if name != part:
                out[(prefix + name).replace(".", "_")] = child
        holder, prefix = getattr(holder, part), prefix + part + "."
    return out


def _inferred_layers(
    model: nn.Module, kind: str, share: SequenceShare | None = None
) -> list[nn.Module]:
    """The layers of a model without a ``base_model_pp_plan``
    [Note: a cut inferred from the module tree]."""
    import inspect

    base: nn.Module = getattr(model, "base_model", model)
    name = type(model).__name__
    found = _block_list(base)
    if found is None or model is base:
        raise ValueError(
            f"pipeline parallelism: {name} has no base_model_pp_plan, and pc finds no single "
            "list of two or more blocks of one class under its base model (with a head) to cut "
            "it at. Build the stages yourself with pc_pipeline (partition a Sequential)."
        )
    path, blocks = found
    if "inputs_embeds" not in inspect.signature(base.forward).parameters:
        # [Note: blocks passed nothing but the hidden states]
        extra = list(inspect.signature(blocks[0].forward).parameters.values())[1:]
        needed = [
            p.name for p in extra
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]  # fmt: skip
        if needed:
            raise ValueError(
                f"pipeline parallelism: {type(base).__name__}'s forward takes no inputs_embeds, "
                "through which pc records what each block is passed, and its blocks need "
                f"{needed}; pc cannot cut it. Build the stages yourself with pc_pipeline."
            )
    others = _outside(base, path)
    shared = {n: m for n, m in others.items() if not any(True for _ in m.parameters())}
    owning = {n: m for n, m in others.items() if n not in shared}
    heads = {n: m for n, m in model.named_children() if m is not base}
    context = _context(model, base, blocks, share, kind)
    first = _PlanEmbed(context, {**owning, **shared})
    middle = [_PlanBlock(context, i, b, shared) for i, b in enumerate(blocks)]
    capture = None
    if kind == "sequence":  # the generic head: taken per position, pooled by the loss
        capture = next(iter(heads.values()))
    find: Any = getattr(base, "get_input_embeddings", None)
    try:
        embedding = find() if callable(find) else None
    except NotImplementedError:
        raise ValueError(
            f"pipeline parallelism: {name} has no base_model_pp_plan and its base model does "
            "not name its input embedding (get_input_embeddings raises NotImplementedError), "
            "so pc cannot tell which modules the first stage alone holds. Build the stages "
            "yourself with pc_pipeline (partition a Sequential)."
        ) from None
    kept = {n: m for n, m in owning.items() if m is not embedding}
    head = _PlanHead(context, {**kept, **shared, **heads}, pooled=False, capture=capture)
    return [first, *middle, head]


def _generic_pooling(model: nn.Module) -> bool:
    """Whether a sequence classifier pools as transformers' decoder models
    do: one linear ``score`` head applied to every position, the last token
    that is not padding pooled (its generic class, and the families that
    write the same head out, such as GPT-NeoX). Encoders pool otherwise
    (a first token, a dense layer)."""
    try:
        from transformers.modeling_layers import GenericForSequenceClassification
    except ImportError:
        GenericForSequenceClassification = None  # noqa: N806
    if GenericForSequenceClassification is not None and isinstance(
        model, GenericForSequenceClassification
    ):
        return True
    base = getattr(model, "base_model", model)
    heads = [(n, m) for n, m in model.named_children() if m is not base]
    return len(heads) == 1 and heads[0][0] == "score" and type(heads[0][1]) is nn.Linear


def pipeline_layers(
    model: nn.Module, share: SequenceShare | None = None
) -> tuple[list[nn.Module], str]:
    """The layers of ``model`` in order, and its loss kind (``"causal"``,
    ``"masked"``, ``"sequence"``, ``"pooled"`` [Note: classifiers that pool
    their own way] or ``"token"``). Any model whose family's
    config has transformers' ``base_model_pp_plan``, with a causal-LM,
    masked-LM, sequence- or token-classification head; GPT-2's LM head and
    BERT's masked LM from pc's own layer lists."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    name = type(model).__name__
    lm: Any = model
    if share is not None and not getattr(config, "base_model_pp_plan", None):
        raise ValueError(
            f"sequence parallelism inside pipeline stages cuts a model from its family's "
            f"base_model_pp_plan; {name} (model_type={kind!r}) has none. Use sequence "
            "parallelism without pipelines, or a family with a plan (Llama, Qwen2, ...)."
        )
    if kind == "gpt2" and name == "GPT2LMHeadModel":
        causal = _needs_causal_mask(model)
        blocks = [_Block(b, causal_mask=causal) for b in lm.transformer.h]
        return [_GPT2Embed(lm), *blocks, _Head(lm.transformer.ln_f, lm.lm_head)], "causal"
    if kind == "bert" and name == "BertForMaskedLM":
        blocks = [_Block(b) for b in lm.bert.encoder.layer]
        return [_BertEmbed(lm), *blocks, _Head(None, lm.cls)], "masked"
    plan = getattr(config, "base_model_pp_plan", None)
    head = next((v for k, v in _HEADS.items() if name.endswith(k)), None)
    if head == "sequence" and not _generic_pooling(model):
        # [Note: classifiers that pool their own way]
        head = "pooled"
    if share is not None and head != "causal":
        raise ValueError(
            f"sequence parallelism inside pipeline stages computes the loss of causal language "
            f"models; {name} has a {head} head."
        )
    if plan and head is not None:
        return _plan_layers(model, dict(plan), head, share), head
    if head is not None:
        return _inferred_layers(model, head, share), head
    raise ValueError(
        f"pipeline parallelism in HybridParallelPlugin cuts a transformers model with a "
        f"{', '.join(_HEADS)} head; {name} (model_type={kind!r}) has none of them. Build "
        "the stages yourself with pc_pipeline (partition a Sequential)."
    )
