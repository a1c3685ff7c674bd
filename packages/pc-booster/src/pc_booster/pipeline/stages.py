"""The pipeline layers a model is cut into (:mod:`.cut`): embedding,
block and head modules, pc's own for GPT-2 and BERT and the ones built
from a ``base_model_pp_plan`` or inferred from the module tree, which call
the model's own forward pieces."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["router_recorder"]


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

    def __init__(
        self,
        index: int,
        calls: list[Any],
        stop: bool,
        value: Any = None,
        router_logits: tuple[torch.Tensor, ...] = (),
        trail: list[tuple[int, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.index, self.calls, self.stop, self.value = index, calls, stop, value
        self.router_logits = router_logits  # [Note: router logits through a pipeline]
        self.trail = trail  # every call: (block index, the hidden states given)

    def __getattr__(self, name: str) -> Any:
        # What the base model's forward reads of the block it stands for
        # (a block's attention_type or block_type choosing its mask).
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("stands_for")
            if block is None:
                raise
            return getattr(block, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args[1:], kwargs)
        if self.trail is not None:
            self.trail.append((self.index, args[0] if args else kwargs.get("hidden_states")))
        if self.router_logits:
            _hand_router_logits(self.router_logits)
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
        # [Note: router logits through a pipeline]: the router logits each
        # block's routers give while a block runs, or None when not recorded.
        self.routed: list[torch.Tensor] | None = None
        self.router_layers = 0  # how many routers the blocks hold

    def record_routers(self, spec: tuple[type[nn.Module], int, str | None]) -> None:
        """Record the output ``spec[1]`` of every module of class ``spec[0]``
        in the blocks (under the dotted ``spec[2]`` when given) while a block
        runs as a pipeline layer."""
        router_class, index, where = spec

        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self.routed is not None:
                self.routed.append(output[index] if isinstance(output, tuple) else output)

        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, router_class) and (
                    where is None or f".{where.strip('.')}." in f".{name}."
                ):
                    module.register_forward_hook(record)
                    self.router_layers += 1

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
                        # not a submodule: the block's parameters stay the block's
                        object.__setattr__(stand_in, "stands_for", originals[i])
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

    def input_embedding(self) -> nn.Module | None:
        """The base model's input embedding, where it names one (some
        models' ``get_input_embeddings`` raises NotImplementedError)."""
        find: Any = getattr(self.base, "get_input_embeddings", None)
        try:
            found = find() if callable(find) else None
        except NotImplementedError:
            return None
        return found if isinstance(found, nn.Module) else None

    def embedding_width(self, hidden: int) -> int:
        """The width of the base model's ``inputs_embeds``: its input
        embedding's, else the hidden states'."""
        width = getattr(self.input_embedding(), "embedding_dim", None)
        return width if isinstance(width, int) else hidden

    def _refuse_repeated_blocks(self, dummy: torch.Tensor, positions: dict[str, Any]) -> None:
        """The forward run past its last block (stand-ins passing their
        input on), to see a block called again after it, as a recurrent
        loop does: refused. A forward that cannot run on the stand-ins'
        outputs past there (it indexes a block's tuple) stops early; what
        it called until then is checked."""
        calls: list[Any] = [None] * len(self.blocks)
        trail: list[tuple[int, Any]] = []
        # Only the calls seen matter here, not how the forward ends.
        stand_in = self.swapped(lambda i: _Recorder(i, calls, stop=False, trail=trail))
        with stand_in, contextlib.suppress(Exception):
            self.call_base(inputs_embeds=dummy, **positions)
        order = [i for i, _ in trail]
        if len(order) != len(set(order)):
            raise ValueError(
                f"pipeline parallelism: {type(self.base).__name__}'s forward calls its blocks "
                f"in the order {order[:16]}, some more than once (a loop over blocks); a "
                "pipeline cut at the blocks runs each once, so pc cannot cut it."
            )

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
                # inputs_embeds are as wide as the embedding, which a model
                # may project to the hidden width (ELECTRA, RemBERT); the
                # arguments recorded do not depend on the values.
                shape = (*hidden.shape[:-1], self.embedding_width(hidden.shape[-1]))
                dummy = torch.zeros(shape, dtype=hidden.dtype, device=hidden.device)
                calls: list[Any] = [None] * len(self.blocks)
                trail: list[tuple[int, Any]] = []
                last = len(self.blocks) - 1
                positions = self.positions(hidden.shape[1], hidden.device)
                with self.swapped(lambda i: _Recorder(i, calls, stop=i == last, trail=trail)):
                    self.call_base(inputs_embeds=dummy, **positions)
                self._refuse_repeated_blocks(dummy, positions)
            if [i for i, _ in trail] != list(range(len(self.blocks))):
                raise ValueError(
                    f"pipeline parallelism: {type(self.base).__name__}'s forward did not call "
                    f"each of its {len(self.blocks)} blocks once in order (it called "
                    f"{[i for i, _ in trail][:12]}: loops over blocks, or skips some); pc "
                    "cannot cut it."
                )
            _check_handed_on(self.base, trail)
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


def _check_handed_on(base: nn.Module, trail: list[tuple[int, Any]]) -> None:
    """Each block's hidden states must be what the one before returned
    (the stand-ins return their input: the same tensor, or a view of it
    when the forward takes ``out[0]`` of a block's tuple); a forward that
    computes between blocks (a norm, a residual from an earlier section)
    cannot be cut at them."""

    def root(t: Any) -> Any:
        return t._base if isinstance(t, torch.Tensor) and t._base is not None else t

    for (_, before), (i, now) in itertools.pairwise(trail):
        if not isinstance(now, torch.Tensor) or root(now) is root(before):
            continue
        raise ValueError(
            f"pipeline parallelism: {type(base).__name__}'s forward changes the hidden "
            f"states between block {i - 1} and block {i} (a norm or a residual outside the "
            "blocks), which a pipeline cut at the blocks would skip; pc cannot cut it. "
            "Build the stages yourself with pc_pipeline (partition a Sequential)."
        )


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

    def forward(self, hidden: torch.Tensor, *routed: torch.Tensor) -> Any:
        args, kwargs = self.context.block_arguments(hidden)[self.index]
        context = self.context
        if context.router_layers:  # [Note: router logits through a pipeline]
            context.routed = []
        try:
            out = self.block(hidden, *args, **kwargs)
            mine = context.routed or []
        finally:
            context.routed = None
        if isinstance(out, (tuple, list)):  # OpenAI GPT's blocks return a list
            context.block_returns_tuple = True
            out = out[0]
        result: torch.Tensor = out
        if not routed and not mine:
            return result
        return result, torch.cat([*routed, *mine])


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

    def forward(self, hidden: torch.Tensor, *routed: torch.Tensor) -> Any:
        if self.pooled:
            for module in self.parts.values():
                hidden = module(hidden)
            return hidden
        handed = (hidden,) if self.context.block_returns_tuple else hidden
        last = len(self.context.blocks) - 1
        layers: tuple[torch.Tensor, ...] = ()
        if routed:  # [Note: router logits through a pipeline]
            layers = routed[0].chunk(self.context.router_layers)
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
            width = context.embedding_width(hidden.shape[-1])
            embeds = hidden
            if width != hidden.shape[-1]:  # projected to the hidden width after embedding
                embeds = hidden.new_zeros((*hidden.shape[:-1], width))  # its values are dropped
            feed = {"inputs_embeds": embeds, "use_cache": False}
        try:

            def stand_in(i: int) -> _Recorder:
                if i != last:
                    return _Recorder(i, calls, stop=False)
                return _Recorder(i, calls, stop=False, value=handed, router_logits=layers)

            with self.context.swapped(stand_in):
                out = self.context.model(**feed)
        finally:
            if handle is not None:
                handle.remove()
        if taken:
            return taken[-1]
        logits = out["logits"] if isinstance(out, dict) else out[0]
        result: torch.Tensor = logits
        aux = out.get("aux_loss") if isinstance(out, dict) and layers else None
        if isinstance(aux, torch.Tensor):  # one per micro-batch, concatenated as outputs
            return result, aux.reshape(1)
        return result


def router_recorder(model: nn.Module) -> tuple[type[nn.Module], int, str | None] | None:
    """Where a ``transformers`` mixture-of-experts model records its router
    logits for its auxiliary loss (the class of its routers, the index of
    the logits in their output, the dotted name they sit under), when its
    config has ``output_router_logits`` on; None otherwise."""
    if getattr(getattr(model, "config", None), "output_router_logits", False) is not True:
        return None
    base = getattr(model, "base_model", model)
    specs = getattr(type(base), "_can_record_outputs", None) or {}
    spec = specs.get("router_logits") if isinstance(specs, dict) else None
    spec = spec[0] if isinstance(spec, list) and len(spec) == 1 else spec
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        return spec, 1, None  # transformers' default index for outputs other than hidden states
    target = getattr(spec, "target_class", None)
    if isinstance(target, type) and issubclass(target, nn.Module):
        return target, int(getattr(spec, "index", 0)), getattr(spec, "layer_name", None)
    raise ValueError(
        f"{type(model).__name__} has output_router_logits=True, and pc cannot tell from its "
        f"_can_record_outputs ({spec!r}) which modules give the router logits its auxiliary "
        "loss adds up, so a pipeline would leave the loss out. Set "
        "model.config.output_router_logits = False to train the pipeline without it, or "
        "train with pp_size=1."
    )


def _hand_router_logits(layers: tuple[torch.Tensor, ...]) -> None:
    """Inside the model's own forward on the last stage, give its output
    recorder the router logits of every layer, carried through the pipeline
    [Note: router logits through a pipeline]."""
    from transformers.utils import output_capturing

    collector = output_capturing._active_collector.get()
    if collector is None or "router_logits" not in collector:
        raise AssertionError("the model's forward is not recording router logits")
    collector["router_logits"].extend(layers)


# [Note: router logits through a pipeline]
# A mixture-of-experts model adds to its loss an auxiliary (load-balancing)
# loss computed from the router logits of every layer, which a pipeline's
# last stage does not hold. The blocks' routers are hooked (the classes
# the model's own output recorder names); each block passes on, beside the
# hidden states, the logits of every router so far, concatenated, so the
# tensor crossing each stage boundary grows by one [tokens, experts] per
# router (a few percent of the hidden states for 8 to 64 experts). On the
# last stage the model's own forward runs after the last block with those
# logits handed to its recorder, so the auxiliary loss is the model's
# function of them, as in one process; the head returns it beside the
# logits, and its gradient flows back through the boundaries to every
# stage's routers.


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
