"""A ``transformers`` model as a sequence of pipeline layers, for the hybrid
plugin: the embedding, each transformer block, and the head, each taking
the previous one's output (token ids, then hidden states, then logits).

Any family whose config carries transformers' ``base_model_pp_plan`` is cut
from it, whatever its head (causal LM, masked LM, sequence or token
classification): each block gets the arguments the base model's own forward
gives it (masks of every kind, rotary embeddings), recorded once per shape
by running that forward with the blocks replaced; the first layer is that
forward up to the first block, the last the model's forward after the last
block. GPT-2 and BERT, which have no plan, are cut from pc's own lists:

Causal models get their causal mask from the attention itself under
``sdpa`` and FlashAttention (``is_causal`` when no mask is given); under
``eager`` attention, which applies only the mask it is given, every block
gets an explicit causal mask. BERT attends everywhere, as the whole model
does for unpadded batches. Padding masks are not carried through the
pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SequenceShare", "feed_inputs", "pipeline_layers"]


class _GPT2Embed(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = lm.transformer.wte, lm.transformer.wpe, lm.transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(positions))
        return out


_CAUSAL_ITSELF = ("sdpa", "flash_attention_2", "flash_attention_3")


def _needs_causal_mask(model: nn.Module) -> bool:
    """Whether the blocks' attention must be given the causal mask."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl in _CAUSAL_ITSELF:
        return False
    if impl == "eager":
        return True
    raise ValueError(
        f"pipeline parallelism runs the blocks under the {impl!r} attention "
        f"implementation, which it cannot give a causal mask; use one of "
        f"{', '.join(map(repr, (*_CAUSAL_ITSELF, 'eager')))} "
        "(model.set_attn_implementation('sdpa'))."
    )


class _Block(nn.Module):
    """A transformer block called on the hidden states alone."""

    def __init__(
        self, block: nn.Module, rotary: nn.Module | None = None, causal_mask: bool = False
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # Llama: position embeddings computed per stage
        self.causal_mask = causal_mask  # eager attention: the mask is given, not implied

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.causal_mask:
            length = hidden.shape[1]
            blocked = torch.full(
                (length, length), torch.finfo(hidden.dtype).min, dtype=hidden.dtype,
                device=hidden.device,
            )  # fmt: skip
            kwargs["attention_mask"] = blocked.triu(1)[None, None]
        if self.rotary is not None:
            positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
        out = self.block(hidden, **kwargs)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


class _Head(nn.Module):
    def __init__(self, norm: nn.Module | None, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(hidden) if self.norm is not None else hidden)
        return out


class _BertEmbed(nn.Module):
    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.embeddings = lm.bert.embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embeddings(input_ids=ids)
        return out


class _Stop(Exception):  # noqa: N818  (control flow, not an error)
    """Raised inside a base model's forward once what was needed is seen."""

    def __init__(self, hidden: Any = None) -> None:
        super().__init__()
        self.hidden = hidden


class _Recorder(nn.Module):
    """Stands in for block ``index`` during one base-model forward: keeps
    the arguments the base model passes it (masks, position embeddings)
    and passes the hidden states on, or stops the forward."""

    def __init__(self, index: int, calls: list[Any], stop: bool, value: Any = None) -> None:
        super().__init__()
        self.index, self.calls, self.stop, self.value = index, calls, stop, value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args[1:], kwargs)
        if self.stop:
            raise _Stop(args[0] if args else kwargs.get("hidden_states"))
        return args[0] if self.value is None else self.value


@dataclass(frozen=True)
class SequenceShare:
    """Sequence parallelism inside pipeline stages: ``positions(total,
    device)`` gives the positions of a ``total``-token sequence this rank
    holds, one of ``parts`` equal shares of the tokens."""

    positions: Callable[[int, torch.device], torch.Tensor]
    parts: int


class _PlanContext:
    """What a model's pipeline layers share: the model, its base model and
    block list, and, per hidden-state shape, the arguments the base model's
    own forward passes each block (its causal or sliding-window masks,
    rotary position embeddings, position ids), found by running that
    forward with every block replaced by a recorder. They depend on the
    shape alone (padding masks are not carried), so they are computed once
    per shape, on real tensors even inside a shape-inference pass."""

    def __init__(
        self,
        model: nn.Module,
        base: nn.Module,
        blocks: nn.ModuleList,
        share: SequenceShare | None = None,
    ) -> None:
        import inspect

        self.model, self.base, self.blocks = model, base, blocks
        self.share = share  # sequence parallelism: the positions this rank holds
        self.cache: dict[Any, list[Any]] = {}
        self.block_returns_tuple = False
        # The input the first stage is fed (token ids, or an image model's
        # pixel_values), and this step's batch of it on every stage, set by
        # feed_inputs: the last stage of a model whose forward takes no
        # inputs_embeds runs that forward on a batch of its shape.
        self.main = str(getattr(model, "main_input_name", "input_ids"))
        self.inputs: torch.Tensor | None = None
        accepted = inspect.signature(base.forward).parameters
        # [Note: blocks passed nothing but the hidden states]
        self.plain_blocks = "inputs_embeds" not in accepted
        self.takes_cache = "use_cache" in accepted

    def positions(self, local: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Under sequence parallelism, ``position_ids`` of this rank's
        ``local`` tokens in the whole sequence; else nothing."""
        if self.share is None:
            return {}
        return {"position_ids": self.share.positions(local * self.share.parts, device)[None]}

    def swapped(self, make: Any) -> Any:
        """A context manager: each block ``i`` replaced by ``make(i)`` (None
        keeps it) for the duration."""
        from contextlib import contextmanager

        @contextmanager
        def run() -> Any:
            originals = list(self.blocks)
            try:
                for i in range(len(originals)):
                    stand_in = make(i)
                    if stand_in is not None:
                        self.blocks[i] = stand_in
                yield
            finally:
                for i, block in enumerate(originals):
                    self.blocks[i] = block

        return run()

    def call_base(self, **inputs: Any) -> Any:
        extra = {"use_cache": False} if self.takes_cache else {}
        try:
            return self.base(**extra, **inputs)
        except _Stop as stop:
            return stop

    def block_arguments(self, hidden: torch.Tensor) -> list[Any]:
        if self.plain_blocks:  # [Note: blocks passed nothing but the hidden states]
            return [((), {})] * len(self.blocks)
        if hidden.dim() != 3:
            raise ValueError(
                f"pipeline parallelism: {type(self.base).__name__}'s blocks pass hidden states "
                f"of shape {tuple(hidden.shape)}, not [batch, sequence, hidden] as its "
                "embeddings (several residual streams); pc cannot cut it."
            )
        key = (tuple(hidden.shape), hidden.dtype, str(hidden.device))
        found = self.cache.get(key)
        if found is None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily(), torch.no_grad():
                dummy = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                calls: list[Any] = [None] * len(self.blocks)
                last = len(self.blocks) - 1
                with self.swapped(lambda i: _Recorder(i, calls, stop=i == last)):
                    self.call_base(
                        inputs_embeds=dummy, **self.positions(hidden.shape[1], hidden.device)
                    )
            if any(c is None for c in calls):
                raise ValueError(
                    f"pipeline parallelism: {type(self.base).__name__}'s forward did not call "
                    f"each of its {len(self.blocks)} blocks once in order; pc cannot cut it."
                )
            for i, (args, kwargs) in enumerate(calls):
                for name, value in [*enumerate(args), *kwargs.items()]:
                    if not _carried(value):
                        raise ValueError(
                            f"pipeline parallelism: {type(self.base).__name__} passes block {i} "
                            f"{name!r}, a {type(value).__name__} its blocks share state "
                            "through (key/value sharing across layers, a cache); a pipeline "
                            "carries only the hidden states between stages, so pc cannot cut it."
                        )
            found = self.cache[key] = calls
        return found


def _carried(value: Any) -> bool:
    """Whether a block argument is fixed per shape (a mask, rotary
    embeddings, positions, flags), not state the blocks share."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    if isinstance(value, tuple):
        return all(_carried(v) for v in value)
    return False


class _PlanEmbed(nn.Module):
    """The first layer: the base model's forward up to its first block (the
    embedding and whatever the model does to it: scaling, dropout)."""

    def __init__(self, context: _PlanContext, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.context = context
        self.parts = nn.ModuleDict(modules)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        calls: list[Any] = [None] * len(self.context.blocks)
        extra: dict[str, torch.Tensor] = {}
        share = self.context.share
        if share is not None:  # sequence parallelism: this rank's tokens
            mine = share.positions(ids.shape[1], ids.device)
            ids, extra = ids.index_select(1, mine), {"position_ids": mine[None]}
        with self.context.swapped(lambda i: _Recorder(i, calls, stop=True) if i == 0 else None):
            stop = self.context.call_base(**{self.context.main: ids}, **extra)
        if not isinstance(stop, _Stop) or not isinstance(stop.hidden, torch.Tensor):
            raise ValueError(
                f"pipeline parallelism: {type(self.context.base).__name__}'s forward did not "
                "reach its first block with the hidden states; pc cannot cut it."
            )
        return stop.hidden


class _PlanBlock(nn.Module):
    """Block ``index`` called with the arguments its base model gives it."""

    def __init__(
        self, context: _PlanContext, index: int, block: nn.Module, shared: dict[str, nn.Module]
    ) -> None:
        super().__init__()
        self.context, self.index = context, index
        self.block = block
        self.shared = nn.ModuleDict(shared)  # parameter-free: rotary embeddings

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.context.block_arguments(hidden)[self.index]
        out = self.block(hidden, *args, **kwargs)
        if isinstance(out, tuple):
            self.context.block_returns_tuple = True
            out = out[0]
        result: torch.Tensor = out
        return result


class _PlanHead(nn.Module):
    """The last layer: what the model does after its last block (final
    norm, the head, soft-capping or scaling of the logits), by running the
    model's own forward with every block standing aside and the last one
    handing over these hidden states. Sequence classification applies its
    head to every position; the loss pools them (it has the token ids)."""

    def __init__(
        self,
        context: _PlanContext,
        modules: dict[str, nn.Module],
        pooled: bool,
        capture: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.context, self.pooled = context, pooled
        self.parts = nn.ModuleDict(modules)
        # A head whose output is taken as it leaves the head, before the
        # model pools it (a per-position sequence classifier without a plan,
        # [Note: classifiers that pool their own way]).
        self.capture = capture

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pooled:
            for module in self.parts.values():
                hidden = module(hidden)
            return hidden
        handed = (hidden,) if self.context.block_returns_tuple else hidden
        last = len(self.context.blocks) - 1
        calls: list[Any] = [None] * len(self.context.blocks)
        taken: list[torch.Tensor] = []
        handle = (
            self.capture.register_forward_hook(lambda m, a, out: taken.append(out))
            if self.capture is not None
            else None
        )
        context = self.context
        if context.plain_blocks:
            # The forward takes no inputs_embeds: run it on zeros shaped as
            # this micro-batch's input; what its embedding makes is dropped.
            if context.inputs is None:
                raise AssertionError("feed_inputs was not called before the pipeline ran")
            shape = (hidden.shape[0], *context.inputs.shape[1:])
            feed: dict[str, Any] = {context.main: context.inputs.new_zeros(shape)}
        else:
            feed = {"inputs_embeds": hidden, "use_cache": False}
        try:
            with self.context.swapped(
                lambda i: _Recorder(i, calls, stop=False, value=handed if i == last else None)
            ):
                out = self.context.model(**feed)
        finally:
            if handle is not None:
                handle.remove()
        if taken:
            return taken[-1]
        logits = out["logits"] if isinstance(out, dict) else out[0]
        result: torch.Tensor = logits
        return result


# [Note: blocks passed nothing but the hidden states]
# A base model whose forward takes no inputs_embeds (ViT's, fed
# pixel_values) cannot have what it passes each block recorded with a
# dummy of the hidden states. Its blocks are called with the hidden states
# alone, which is refused unless every other parameter of the blocks'
# forward has a default; its last stage runs the model's forward on zeros
# shaped as the micro-batch's input (feed_inputs gives the shape), the
# blocks standing aside and the last handing over the hidden states, so the
# final norm, pooling and head are the model's own; what its embedding
# computes from the zeros is dropped.


def feed_inputs(pipe: nn.Module, inputs: torch.Tensor) -> None:
    """Give the pipeline layers in ``pipe`` this step's batch of the model's
    main input [Note: blocks passed nothing but the hidden states]."""
    for module in pipe.modules():
        if isinstance(module, _PlanHead):
            module.context.inputs = inputs


# [Note: classifiers that pool their own way]
# A sequence classifier that pools as transformers' generic head does (one
# linear ``score`` on every position, the last token that is not padding)
# is cut with its head applied to every position, and the loss pools
# (kind "sequence"; without a plan, the model's own forward runs on the
# last stage and the head's output is taken per position as it leaves the
# head, before the model pools it). One that pools its own way (BERT's pooler on the first
# token, a mean, a dense layer) keeps its own: the last stage runs the
# model's forward after the last block, pooler and classifier included, and
# the loss takes its per-row logits (kind "pooled").

_HEADS = {
    "ForCausalLM": "causal",
    "LMHeadModel": "causal",
    "ForMaskedLM": "masked",
    "ForSequenceClassification": "sequence",
    "ForTokenClassification": "token",
    "ForImageClassification": "pooled",
}


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
    context = _PlanContext(model, base, blocks, share)
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
    context = _PlanContext(model, base, blocks, share)
    first = _PlanEmbed(context, {**owning, **shared})
    middle = [_PlanBlock(context, i, b, shared) for i, b in enumerate(blocks)]
    capture = None
    if kind == "sequence":  # the generic head: taken per position, pooled by the loss
        capture = next(iter(heads.values()))
    find: Any = getattr(base, "get_input_embeddings", None)
    embedding = find() if callable(find) else None
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
