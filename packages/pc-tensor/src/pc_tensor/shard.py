"""``shard_model``: apply a :class:`~pc_tensor.policies.Policy` to a
``transformers`` model in place.

What changes, per block: the policy's column and row projections become
:class:`ColumnParallelLinear` / :class:`RowParallelLinear` (``Conv1D`` read
transposed), the attention modules' head counts and widths become this
rank's share. The token embedding becomes a :class:`VocabParallelEmbedding`
(the vocabulary padded with zero rows to a multiple of tp when it does not
divide), the LM head a column-parallel projection tied to it where the
original was tied, and the model's loss runs through
:func:`vocab_parallel_cross_entropy`, so ``model(ids, labels=ids).loss`` is
the unsharded model's loss while the full logits never exist on any rank.
``outputs.logits`` holds this rank's vocabulary slice; see
:func:`gather_logits`.

Sequence parallelism (``sequence_parallel=True``): the hidden states between
the parallel projections are split along the sequence. The first block's
input is split on entry and the last block's output gathered, so the model
outside the blocks is unchanged; inside, the norms and dropouts run on 1/tp
of the tokens, and the gradients of the parameters every rank holds whole
(norms, row biases) are summed over the group by a hook as they are
computed, so gradient accumulation, ZeRO and pipelines see the full
gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.comm import gather_from_tp, gather_sequence, split_to_tp
from pc_tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from pc_tensor.policies import Policy

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "ShardInfo",
    "ShardSpec",
    "full_shape",
    "full_state_dict",
    "gather_logits",
    "load_full_state_dict",
    "place_local_box",
    "shard_info",
    "shard_model",
    "shard_tensor",
    "unshard_tensor",
]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter was split: along ``dim`` of its sharded layout, as
    ``parts`` fused blocks each split separately, the full tensor cut back to
    ``size`` along ``dim`` (vocabulary padding) and transposed back to the
    original layout where the original was a ``Conv1D``."""

    dim: int
    parts: int = 1
    size: int | None = None
    transpose: bool = False


@dataclass(frozen=True)
class ShardInfo:
    """What :func:`shard_model` did to a model."""

    policy: str
    group: dist.ProcessGroup
    tp_size: int
    sequence_parallel: bool
    vocab_size: int  # 0 where the policy splits no token embedding
    padded_vocab_size: int
    sharded: tuple[str, ...]  # names of the parameters split across the group
    replicated_in_blocks: tuple[str, ...]  # whole on every rank, inside the blocks
    specs: dict[str, ShardSpec]  # state-dict key -> how it was split


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _set(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent), name, value)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


L = TypeVar("L", ColumnParallelLinear, RowParallelLinear)


def _shard_layer(
    cls: type[L], layer: nn.Module, group: dist.ProcessGroup, options: dict[str, Any]
) -> L:
    if _is_conv1d(layer):
        return cls.from_conv1d(layer, group, **options)
    return cls.from_linear(layer, group, **options)  # type: ignore[arg-type]


def _drop_split(layer: nn.Module, materialize: Callable[[nn.Module], None] | None) -> None:
    """A lazily built layer's full weights, once split, are not kept: the
    module stays (its parameters' identities are checked later), empty."""
    if materialize is None:
        return
    with torch.no_grad():
        for param in layer.parameters(recurse=False):
            param.data = param.data.new_empty(0)


def _check_whole_heads(
    block: nn.Module, path: str, layer: nn.Module, parts: int, tp: int, policy: str
) -> None:
    """A projection inside an attention module with a ``head_dim`` must
    split into whole heads: a rank holding part of a head would attend over
    part of its dimensions, silently."""
    parent = _get(block, path.rpartition(".")[0]) if "." in path else block
    head_dim = getattr(parent, "head_dim", None)
    weight = getattr(layer, "weight", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or not isinstance(weight, torch.Tensor):
        return
    out = (weight.shape[1] if _is_conv1d(layer) else weight.shape[0]) // parts
    if out % head_dim == 0 and (out // head_dim) % tp:
        raise ValueError(
            f"{policy}: {path} holds {out // head_dim} heads of {head_dim} (out features "
            f"{out}), which the tensor-parallel size {tp} does not divide; heads are split "
            "whole across ranks. Use a tp size that divides every head count."
        )


def _hidden_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, bool]:
    """The hidden states a block or module was called with, and whether they
    came as a keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], False
    value = kwargs.get("hidden_states")
    return (value, True) if isinstance(value, torch.Tensor) else (None, False)


def _replace_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], keyword: bool, value: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if keyword:
        kwargs = {**kwargs, "hidden_states": value}
        return args, kwargs
    return (value, *args[1:]), kwargs


def _input_hook(
    transform: Any,
) -> Any:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden, keyword = _hidden_arg(args, kwargs)
        if hidden is None:
            raise TypeError(
                f"sequence parallelism: {type(module).__name__} was called without a "
                "hidden_states tensor as its first argument or keyword."
            )
        return _replace_hidden(args, kwargs, keyword, transform(hidden))

    return hook


def _split_sequence(group: dist.ProcessGroup, hidden: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size(group)
    if hidden.dim() < 2 or hidden.shape[1] % world:
        raise ValueError(
            f"sequence parallelism splits the sequence (dim 1) over {world} ranks, but the "
            f"hidden states have shape {tuple(hidden.shape)}; pad the sequence length to a "
            f"multiple of {world} (or shard with sequence_parallel=False)."
        )
    return split_to_tp(hidden, group, dim=1)


def _gather_output(group: dist.ProcessGroup, module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return gather_from_tp(output, group, dim=1)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (gather_from_tp(output[0], group, dim=1), *output[1:])
    raise TypeError(
        f"sequence parallelism: the last block ({type(module).__name__}) returned "
        f"{type(output).__name__}; expected a tensor or a tuple starting with one."
    )


def _sum_over_group(group: dist.ProcessGroup, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class _VocabParallelLossForward:
    """Replaces the forward of a model whose LM head is vocabulary-sharded:
    the labels are kept from the original forward (which would compute the
    loss over the full vocabulary it no longer has, some inline, some
    through ``loss_function``), and the loss is computed here from the
    sharded logits, as ``transformers`` defines it: next-token (labels
    shifted by one) for causal models, position-wise for masked ones;
    ``-100`` ignored; ``num_items_in_batch`` and ``shift_labels`` honoured."""

    def __init__(self, forward: Any, group: dist.ProcessGroup, causal: bool) -> None:
        self.forward, self.group, self.causal = forward, group, causal

    def __call__(self, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        out = self.forward(*args, **kwargs)
        if shift_labels is not None:
            target = shift_labels
        elif labels is None:
            return out
        elif self.causal:
            target = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        else:
            target = labels
        logits = out["logits"] if isinstance(out, dict) else out[0]
        loss = vocab_parallel_cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            target.to(logits.device).reshape(-1),
            self.group,
            num_items=num_items,
        )
        if isinstance(out, tuple):
            return (loss, *out)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})


def shard_model(
    model: M,
    tp_group: dist.ProcessGroup | None = None,
    policy: Policy | None = None,
    *,
    sequence_parallel: bool = False,
    pad_vocab: bool = True,
    materialize: Callable[[nn.Module], None] | None = None,
) -> M:
    """Shard ``model`` over ``tp_group`` (default: the world) in place and
    return it. Every rank of the group must call it with the same model
    (same weights: build it from the same seed, or load the same
    checkpoint). ``policy`` defaults to the family's transformers plan, else
    pc's policy for its ``config.model_type``, else one inferred from its
    module tree (:func:`~pc_tensor.infer_plan`); ``pad_vocab=False`` turns a
    vocabulary tp does not divide into an error instead of padding.

    ``materialize``: for a model built without memory (lazily), called on
    each layer right before its weights are split, and on the whole model
    at the end for what is left (norms, biases, position embeddings); each
    split layer's full weights are dropped at once, so the whole model
    never exists on a rank (pc-booster passes pc-chunk's materialisation)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed initialised (torchrun, or "
            "dist.init_process_group) and a tensor-parallel group."
        )
    group = tp_group if tp_group is not None else dist.group.WORLD
    assert group is not None
    if getattr(model, "_pc_tensor", None) is not None:
        raise ValueError("this model is already sharded (shard_model was called on it before).")
    config = getattr(model, "config", None)
    if policy is None:
        from pc_tensor.inferred import policy_or_inferred

        policy = policy_or_inferred(model)
    tp = dist.get_world_size(group)
    for name in policy.head_counts:
        count = getattr(config, name, None)
        if isinstance(count, int) and count % tp:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(
                f"{policy.name}: config.{name} = {count} is not divisible by the tensor-"
                f"parallel size {tp}; attention heads are split whole across ranks. Use a tp "
                f"size in {fits}."
            )
    if policy.check is not None and (problem := policy.check(config)) is not None:
        raise ValueError(problem)

    base: nn.Module = getattr(model, "base_model", model)
    try:
        blocks = list(_get(base, policy.blocks))
        # An empty path: no token embedding to split (an inferred plan).
        embedding = _get(base, policy.embedding) if policy.embedding else None
    except AttributeError as exc:
        raise ValueError(
            f"policy {policy.name!r} does not fit {type(model).__name__}: {exc}. The "
            "policy's paths are relative to model.base_model."
        ) from exc
    if embedding is not None and not isinstance(embedding, nn.Embedding):
        raise TypeError(
            f"policy {policy.name!r}: {policy.embedding} is {type(embedding).__name__}, "
            "expected nn.Embedding."
        )
    if (
        embedding is not None
        and type(embedding) is not nn.Embedding
        and not hasattr(embedding, "embed_scale")
    ):
        raise ValueError(
            f"policy {policy.name!r}: the token embedding {policy.embedding} is "
            f"{type(embedding).__name__}, a subclass of nn.Embedding with a forward of its own "
            "that pc cannot split by vocabulary (it knows a plain embedding and one scaled by "
            "embed_scale)."
        )
    if embedding is None and type(model).__name__ in policy.lm_heads:
        raise ValueError(
            f"policy {policy.name!r} splits {type(model).__name__}'s output layer by "
            "vocabulary but names no token embedding (policy.embedding is empty); name it."
        )

    specs: dict[int, ShardSpec] = {}  # id of a new sharded parameter -> its split
    replaced: set[int] = set()  # ids of the original parameters now sharded away
    # Holds the originals alive until the end: a freed one's id may be reused.
    originals: list[nn.Module] = []
    sharded: set[int] = set()  # ids of the new sharded parameters
    for block in blocks:
        gathered = [prefix + "." for prefix in policy.gather_at]
        for path, parts in policy.column.items():
            old = _get(block, path)
            _check_whole_heads(block, path, old, parts, tp, policy.name)
            inside = sequence_parallel and any(path.startswith(p) for p in gathered)
            options: dict[str, Any] = {
                "parts": parts,
                "sequence_parallel": sequence_parallel and not inside,
                "input_gathered": inside,
                "sequence_dim": 0 if path in policy.flat_tokens else 1,
                "gather_output": path in policy.gather_output,
            }
            if materialize is not None:
                materialize(old)
            new = _shard_layer(ColumnParallelLinear, old, group, options)
            _drop_split(old, materialize)
            replaced.update(id(p) for p in old.parameters())
            originals.append(old)
            sharded.update(id(p) for p in new.parameters())
            conv = _is_conv1d(old)
            specs[id(new.weight)] = ShardSpec(0, parts, transpose=conv)
            if new.bias is not None:
                specs[id(new.bias)] = ShardSpec(0, parts)
            _set(block, path, new)
        for path in policy.row:
            old = _get(block, path)
            row_options: dict[str, Any] = {
                "sequence_parallel": sequence_parallel,
                "sequence_dim": 0 if path in policy.flat_tokens else 1,
                "input_is_parallel": path not in policy.split_input,
            }
            if materialize is not None:
                materialize(old)
            row = _shard_layer(RowParallelLinear, old, group, row_options)
            _drop_split(old, materialize)
            replaced.update(id(p) for p in old.parameters())
            originals.append(old)
            sharded.add(id(row.weight))
            specs[id(row.weight)] = ShardSpec(1, transpose=_is_conv1d(old))
            _set(block, path, row)
        for path, attributes in policy.heads.items():
            attention = _get(block, path)
            for attribute in attributes:
                value = getattr(attention, attribute)
                if value % tp:
                    raise ValueError(
                        f"{policy.name}: {path}.{attribute} = {value} is not divisible by "
                        f"the tensor-parallel size {tp}."
                    )
                setattr(attention, attribute, value // tp)
            if policy.prepare_attention is not None:
                policy.prepare_attention(attention, group)

    vocab = padded = 0
    new_embedding: VocabParallelEmbedding | None = None
    if embedding is not None:
        vocab = embedding.num_embeddings
        padded = -(-vocab // tp) * tp if pad_vocab else vocab
        if materialize is not None:
            materialize(embedding)
        new_embedding = VocabParallelEmbedding.from_embedding(embedding, group, padded_size=padded)
        replaced.add(id(embedding.weight))
        originals.append(embedding)
        sharded.add(id(new_embedding.weight))
        specs[id(new_embedding.weight)] = ShardSpec(0, size=vocab)
        _set(base, policy.embedding, new_embedding)

    retie: dict[int, nn.Parameter] = {}
    head_path = policy.lm_heads.get(type(model).__name__)
    if head_path is not None:
        head = _get(model, head_path)
        if materialize is not None:
            materialize(head)
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        if padded != vocab:
            weight = torch.cat([weight, weight.new_zeros(padded - vocab, weight.shape[1])])
            bias = torch.cat([bias, bias.new_zeros(padded - vocab)]) if bias is not None else None
        new_head = ColumnParallelLinear(
            weight, bias, group, valid_out_features=vocab if padded != vocab else None
        )
        if embedding is not None and head.weight is embedding.weight:
            assert new_embedding is not None
            new_head.weight = new_embedding.weight
        replaced.update(id(p) for p in head.parameters())
        originals.append(head)
        sharded.update(id(p) for p in new_head.parameters())
        specs.update({id(p): ShardSpec(0, size=vocab) for p in new_head.parameters()})
        if head.bias is not None and new_head.bias is not None:
            retie[id(head.bias)] = new_head.bias  # BERT's predictions.bias is decoder.bias
        _set(model, head_path, new_head)
        model.forward = _VocabParallelLossForward(
            model.forward, group, causal=policy.loss == "causal"
        )

    # A parameter elsewhere still tied to one that was sharded away (an
    # output layer this policy does not know) would silently train a copy.
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in replaced:
                continue
            if id(param) in retie:
                module._parameters[name] = retie[id(param)]
                continue
            raise ValueError(
                f"{type(model).__name__}.{module_name}.{name} is tied to a parameter that "
                f"tensor parallelism shards, and policy {policy.name!r} does not shard it. "
                f"Classes whose output layer it shards: {', '.join(policy.lm_heads)}; "
                "other heads must not share the embedding or the block projections."
            )

    if materialize is not None:  # what no layer split: norms, biases, position embeddings
        materialize(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        if id(param) in sharded:
            # Megatron's marker, read by pc_zero's gradient clipping: this
            # parameter's norm sums over the tensor-parallel group.
            param.tensor_model_parallel = True  # type: ignore[attr-defined]
    replicated: list[str] = []
    if sequence_parallel:
        blocks[0].register_forward_pre_hook(
            _input_hook(partial(_split_sequence, group)), with_kwargs=True
        )
        blocks[-1].register_forward_hook(partial(_gather_output, group))
        for block in blocks:
            for path in policy.gather_at:
                _get(block, path).register_forward_pre_hook(
                    _input_hook(partial(gather_sequence, group=group)), with_kwargs=True
                )
    for block in blocks:
        # Whose gradient is partial on each rank, so summed over the group:
        # under sequence parallelism, the parameters that see this rank's
        # slice of the sequence (outside the gathered modules, and the row
        # layers' biases, added after the reduce-scatter); always, the
        # policy's grad_sum modules (norms over this rank's heads). Inside a
        # gathered module the rest see the whole sequence and whole features.
        partial_grad: set[int] = set()
        for path in policy.grad_sum:
            partial_grad.update(id(p) for p in _get(block, path).parameters())
        if sequence_parallel:
            whole = {id(p) for path in policy.gather_at for p in _get(block, path).parameters()}
            for path in policy.row:
                bias = getattr(_get(block, path), "bias", None)
                if bias is not None:
                    whole.discard(id(bias))
            partial_grad.update(id(p) for p in block.parameters() if id(p) not in whole)
        for param in block.parameters():
            if id(param) in partial_grad and id(param) not in sharded and param.requires_grad:
                param.register_hook(partial(_sum_over_group, group))
                replicated.append(names[id(param)])
    info = ShardInfo(
        policy=policy.name,
        group=group,
        tp_size=tp,
        sequence_parallel=sequence_parallel,
        vocab_size=vocab,
        padded_vocab_size=padded,
        sharded=tuple(n for p_id, n in names.items() if p_id in sharded),
        replicated_in_blocks=tuple(replicated),
        specs={
            key: specs[id(value)]
            for key, value in model.state_dict(keep_vars=True).items()
            if id(value) in specs
        },
    )
    model.__dict__["_pc_tensor"] = info
    return model


def shard_info(model: nn.Module) -> ShardInfo:
    """What :func:`shard_model` did to ``model``."""
    info = getattr(model, "_pc_tensor", None)
    if not isinstance(info, ShardInfo):
        raise ValueError(f"{type(model).__name__} was not sharded with pc_tensor.shard_model.")
    return info


def gather_logits(logits: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The full-vocabulary logits from each rank's slice (padding columns
    dropped). Costs a gather of the whole ``[..., V]`` tensor: for
    inspection and generation, not for the loss."""
    info = shard_info(model)
    full = gather_from_tp(logits, info.group, dim=-1)
    return full[..., : info.vocab_size]


def unshard_tensor(tensor: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor, in the original layout, from every rank's ``tensor``
    split as ``spec`` says (a collective over ``group``)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=group)
    if spec.parts > 1:
        blocks = [p.chunk(spec.parts, dim=spec.dim) for p in pieces]
        full = torch.cat(
            [torch.cat([b[k] for b in blocks], dim=spec.dim) for k in range(spec.parts)],
            dim=spec.dim,
        )
    else:
        full = torch.cat(pieces, dim=spec.dim)
    if spec.size is not None:
        full = full.narrow(spec.dim, 0, spec.size)
    return full.t().contiguous() if spec.transpose else full


def full_shape(spec: ShardSpec, local_shape: torch.Size, world: int) -> torch.Size:
    """The full tensor's shape (original layout, padding dropped) of which
    ``local_shape`` is one of ``world`` shards split as ``spec`` says."""
    shape = list(local_shape)
    shape[spec.dim] = spec.size if spec.size is not None else shape[spec.dim] * world
    return torch.Size(reversed(shape) if spec.transpose else shape)


def place_local_box(
    spec: ShardSpec,
    local_shape: torch.Size,
    rank: int,
    world: int,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Where the box ``offsets`` / ``sizes`` of rank ``rank``'s shard (in
    the shard's own layout) lies in the full tensor, as
    :func:`unshard_tensor` assembles it: one ``(full offsets, local
    offsets, local sizes)`` per contiguous part (a fused projection's
    ``parts`` blocks land apart), padding rows dropped. The full box's
    sizes are the local sizes, reversed where ``spec.transpose``; its
    values are the local box's, transposed there. Index arithmetic only:
    a sharded checkpoint writes each rank's pieces where they belong with
    it, and reads them back from any other layout."""
    dim = spec.dim
    block = local_shape[dim] // spec.parts  # this rank's rows of one part
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out = []
    for part in range(spec.parts):
        start, stop = max(lo, part * block), min(hi, (part + 1) * block)
        if start >= stop:
            continue
        where = part * block * world + rank * block + (start - part * block)
        count = stop - start
        if spec.size is not None:  # vocabulary padding past the real rows
            count = min(count, spec.size - where)
            if count <= 0:
                continue
        local_offsets, local_sizes, full_offsets = list(offsets), list(sizes), list(offsets)
        local_offsets[dim], local_sizes[dim], full_offsets[dim] = start, count, where
        if spec.transpose:
            full_offsets.reverse()
        out.append((tuple(full_offsets), tuple(local_offsets), tuple(local_sizes)))
    return out


def full_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (its keys and layouts: ``Conv1D``
    transposed back, vocabulary padding dropped), gathered on every rank of
    the group; ``load_state_dict`` of the original model takes it. With
    ``grads=True``, the full gradients instead (zeros where none)."""
    info = shard_info(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        tensor = value
        if grads:
            grad = value.grad if isinstance(value, nn.Parameter) else None
            tensor = grad if grad is not None else torch.zeros_like(value)
        spec = info.specs.get(key)
        out[key] = (
            unshard_tensor(tensor, spec, info.group)
            if spec is not None
            else tensor.detach().clone()
        )
    return out


def shard_tensor(
    full: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup, local_shape: torch.Size
) -> torch.Tensor:
    """This rank's piece of ``full`` (original layout) split as ``spec``
    says, shaped ``local_shape``: the inverse of :func:`unshard_tensor`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tensor = full.t() if spec.transpose else full
    if spec.size is not None:  # padding rows up to the padded vocabulary
        padded = local_shape[spec.dim] * world
        extra = padded - tensor.shape[spec.dim]
        if extra:
            shape = list(tensor.shape)
            shape[spec.dim] = extra
            tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=spec.dim)
    if spec.parts > 1:
        pieces = [p.chunk(world, dim=spec.dim)[rank] for p in tensor.chunk(spec.parts, spec.dim)]
        mine = torch.cat(pieces, dim=spec.dim)
    else:
        mine = tensor.chunk(world, dim=spec.dim)[rank]
    if mine.shape != local_shape:
        raise ValueError(
            f"a full tensor of shape {tuple(full.shape)} does not shard to this rank's "
            f"{tuple(local_shape)}: was it saved from another model?"
        )
    return mine.contiguous()


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (as :func:`full_state_dict` gives, or
    the original model's) into the sharded ``model``: each rank keeps its
    piece. Keys and shapes are checked as ``load_state_dict`` does."""
    info = shard_info(model)
    own = model.state_dict()
    local: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        spec = info.specs.get(key)
        if spec is not None and key in own:
            value = shard_tensor(value, spec, info.group, own[key].shape)
        local[key] = value.to(own[key].dtype) if key in own else value
    model.load_state_dict(local)
