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

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.comm import gather_from_tp, gather_sequence
from pc_tensor.hooks import (
    VocabParallelLoss,
    gather_output,
    input_hook,
    split_sequence,
    sum_over_group,
)
from pc_tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pc_tensor.policies import Policy
from pc_tensor.specs import ShardSpec, full_shape, shard_tensor, unshard_tensor

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "ShardInfo",
    "full_state_dict",
    "gather_logits",
    "load_full_state_dict",
    "shard_info",
    "shard_model",
]


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


# pc-tensor's record of the models shard_model sharded (read through
# shard_info): weak references, nothing written on the user's model.
_SHARDED: weakref.WeakKeyDictionary[nn.Module, ShardInfo] = weakref.WeakKeyDictionary()


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


def _check_fits(model: nn.Module, policy: Policy, tp: int) -> None:
    """The config's head counts divide by ``tp``, and the policy's own
    check passes."""
    config = getattr(model, "config", None)
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


def _locate(model: nn.Module, policy: Policy) -> tuple[nn.Module, list[nn.Module], Any]:
    """The base model, its blocks and its token embedding (None where the
    policy names none), as ``policy`` names them; errors where they do not
    fit the model."""
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
    return base, blocks, embedding


class _Sharding:
    """One :func:`shard_model` call: what it shards with, and what it did so
    far, by parameter identity."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        policy: Policy,
        sequence_parallel: bool,
        materialize: Callable[[nn.Module], None] | None,
    ) -> None:
        self.model, self.group, self.policy = model, group, policy
        self.tp = dist.get_world_size(group)
        self.sequence_parallel, self.materialize = sequence_parallel, materialize
        self.specs: dict[int, ShardSpec] = {}  # id of a new sharded parameter -> its split
        self.replaced: set[int] = set()  # ids of the original parameters now sharded away
        # Holds the originals alive until the end: a freed one's id may be reused.
        self.originals: list[nn.Module] = []
        self.sharded: set[int] = set()  # ids of the new sharded parameters
        self.retie: dict[int, nn.Parameter] = {}  # an original's id -> the parameter it becomes
        self.vocab = self.padded = 0

    def block(self, block: nn.Module) -> None:
        """One block's projections split, its attention modules set to this
        rank's heads."""
        self.columns(block)
        self.rows(block)
        self.heads(block)

    def columns(self, block: nn.Module) -> None:
        policy, sequence_parallel = self.policy, self.sequence_parallel
        gathered = [prefix + "." for prefix in policy.gather_at]
        for path, parts in policy.column.items():
            old = _get(block, path)
            _check_whole_heads(block, path, old, parts, self.tp, policy.name)
            inside = sequence_parallel and any(path.startswith(p) for p in gathered)
            options: dict[str, Any] = {
                "parts": parts,
                "sequence_parallel": sequence_parallel and not inside,
                "input_gathered": inside,
                "sequence_dim": 0 if path in policy.flat_tokens else 1,
                "gather_output": path in policy.gather_output,
            }
            if self.materialize is not None:
                self.materialize(old)
            new = _shard_layer(ColumnParallelLinear, old, self.group, options)
            _drop_split(old, self.materialize)
            self.replaced.update(id(p) for p in old.parameters())
            self.originals.append(old)
            self.sharded.update(id(p) for p in new.parameters())
            conv = _is_conv1d(old)
            self.specs[id(new.weight)] = ShardSpec(0, parts, transpose=conv)
            if new.bias is not None:
                self.specs[id(new.bias)] = ShardSpec(0, parts)
            _set(block, path, new)

    def rows(self, block: nn.Module) -> None:
        policy = self.policy
        for path in policy.row:
            old = _get(block, path)
            row_options: dict[str, Any] = {
                "sequence_parallel": self.sequence_parallel,
                "sequence_dim": 0 if path in policy.flat_tokens else 1,
                "input_is_parallel": path not in policy.split_input,
            }
            if self.materialize is not None:
                self.materialize(old)
            row = _shard_layer(RowParallelLinear, old, self.group, row_options)
            _drop_split(old, self.materialize)
            self.replaced.update(id(p) for p in old.parameters())
            self.originals.append(old)
            self.sharded.add(id(row.weight))
            self.specs[id(row.weight)] = ShardSpec(1, transpose=_is_conv1d(old))
            _set(block, path, row)

    def heads(self, block: nn.Module) -> None:
        policy, tp = self.policy, self.tp
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
                policy.prepare_attention(attention, self.group)

    def embedding(
        self, base: nn.Module, embedding: nn.Embedding | None, pad_vocab: bool
    ) -> VocabParallelEmbedding | None:
        """The token embedding split by vocabulary (padded to a multiple of
        tp unless ``pad_vocab`` is false); None where there is none."""
        if embedding is None:
            return None
        tp = self.tp
        self.vocab = vocab = embedding.num_embeddings
        self.padded = padded = -(-vocab // tp) * tp if pad_vocab else vocab
        if self.materialize is not None:
            self.materialize(embedding)
        new = VocabParallelEmbedding.from_embedding(embedding, self.group, padded_size=padded)
        self.replaced.add(id(embedding.weight))
        self.originals.append(embedding)
        self.sharded.add(id(new.weight))
        self.specs[id(new.weight)] = ShardSpec(0, size=vocab)
        _set(base, self.policy.embedding, new)
        return new

    def lm_head(
        self, embedding: nn.Embedding | None, new_embedding: VocabParallelEmbedding | None
    ) -> None:
        """The policy's output layer for this model class split by
        vocabulary, tied to the embedding where it was, and the model's
        loss computed from the split logits."""
        model, policy, vocab, padded = self.model, self.policy, self.vocab, self.padded
        head_path = policy.lm_heads.get(type(model).__name__)
        if head_path is None:
            return
        head = _get(model, head_path)
        if self.materialize is not None:
            self.materialize(head)
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        if padded != vocab:
            weight = torch.cat([weight, weight.new_zeros(padded - vocab, weight.shape[1])])
            bias = torch.cat([bias, bias.new_zeros(padded - vocab)]) if bias is not None else None
        new_head = ColumnParallelLinear(
            weight, bias, self.group, valid_out_features=vocab if padded != vocab else None
        )
        if embedding is not None and head.weight is embedding.weight:
            assert new_embedding is not None
            new_head.weight = new_embedding.weight
        self.replaced.update(id(p) for p in head.parameters())
        self.originals.append(head)
        self.sharded.update(id(p) for p in new_head.parameters())
        self.specs.update({id(p): ShardSpec(0, size=vocab) for p in new_head.parameters()})
        if head.bias is not None and new_head.bias is not None:
            self.retie[id(head.bias)] = new_head.bias  # BERT's predictions.bias is decoder.bias
        _set(model, head_path, new_head)
        VocabParallelLoss(self.group, causal=policy.loss == "causal").hook(model)

    def check_ties(self) -> None:
        """A parameter elsewhere still tied to one that was sharded away (an
        output layer this policy does not know) would silently train a
        copy: retied where known, refused otherwise."""
        model, policy = self.model, self.policy
        for module_name, module in model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is None or id(param) not in self.replaced:
                    continue
                if id(param) in self.retie:
                    module._parameters[name] = self.retie[id(param)]
                    continue
                raise ValueError(
                    f"{type(model).__name__}.{module_name}.{name} is tied to a parameter that "
                    f"tensor parallelism shards, and policy {policy.name!r} does not shard it. "
                    f"Classes whose output layer it shards: {', '.join(policy.lm_heads)}; "
                    "other heads must not share the embedding or the block projections."
                )

    def mark_sharded(self) -> None:
        for param in self.model.parameters():
            if id(param) in self.sharded:
                # Megatron's marker, read by pc_zero's gradient clipping: this
                # parameter's norm sums over the tensor-parallel group.
                param.tensor_model_parallel = True  # type: ignore[attr-defined]

    def hook_sequence(self, blocks: list[nn.Module]) -> None:
        """Sequence parallelism's hooks: the sequence split on entry to the
        first block, gathered after the last and on entry to the modules
        that read it whole."""
        group = self.group
        blocks[0].register_forward_pre_hook(
            input_hook(partial(split_sequence, group)), with_kwargs=True
        )
        blocks[-1].register_forward_hook(partial(gather_output, group))
        for block in blocks:
            for path in self.policy.gather_at:
                _get(block, path).register_forward_pre_hook(
                    input_hook(partial(gather_sequence, group=group)), with_kwargs=True
                )

    def hook_partial_grads(self, blocks: list[nn.Module], names: dict[int, str]) -> list[str]:
        """Hooks summing over the group the gradients that are partial on
        each rank; returns those parameters' names."""
        policy = self.policy
        replicated: list[str] = []
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
            if self.sequence_parallel:
                whole = {id(p) for path in policy.gather_at for p in _get(block, path).parameters()}
                for path in policy.row:
                    bias = getattr(_get(block, path), "bias", None)
                    if bias is not None:
                        whole.discard(id(bias))
                partial_grad.update(id(p) for p in block.parameters() if id(p) not in whole)
            for param in block.parameters():
                if (
                    id(param) in partial_grad
                    and id(param) not in self.sharded
                    and param.requires_grad
                ):
                    param.register_hook(partial(sum_over_group, self.group))  # type: ignore[no-untyped-call]
                    replicated.append(names[id(param)])
        return replicated

    def info(self, names: dict[int, str], replicated: list[str]) -> ShardInfo:
        return ShardInfo(
            policy=self.policy.name,
            group=self.group,
            tp_size=self.tp,
            sequence_parallel=self.sequence_parallel,
            vocab_size=self.vocab,
            padded_vocab_size=self.padded,
            sharded=tuple(n for p_id, n in names.items() if p_id in self.sharded),
            replicated_in_blocks=tuple(replicated),
            specs={
                key: self.specs[id(value)]
                for key, value in self.model.state_dict(keep_vars=True).items()
                if id(value) in self.specs
            },
        )


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
    if model in _SHARDED:
        raise ValueError("this model is already sharded (shard_model was called on it before).")
    if policy is None:
        from pc_tensor.inferred import policy_or_inferred

        policy = policy_or_inferred(model)
    _check_fits(model, policy, dist.get_world_size(group))
    base, blocks, embedding = _locate(model, policy)
    job = _Sharding(model, group, policy, sequence_parallel, materialize)
    for block in blocks:
        job.block(block)
    new_embedding = job.embedding(base, embedding, pad_vocab)
    job.lm_head(embedding, new_embedding)
    job.check_ties()
    if materialize is not None:  # what no layer split: norms, biases, position embeddings
        materialize(model)
    names = {id(p): n for n, p in model.named_parameters()}
    job.mark_sharded()
    if sequence_parallel:
        job.hook_sequence(blocks)
    replicated = job.hook_partial_grads(blocks, names)
    _SHARDED[model] = job.info(names, replicated)
    return model


def shard_info(model: nn.Module) -> ShardInfo:
    """What :func:`shard_model` did to ``model``."""
    info = _SHARDED.get(model)
    if info is None:
        raise ValueError(f"{type(model).__name__} was not sharded with pc_tensor.shard_model.")
    return info


def gather_logits(logits: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The full-vocabulary logits from each rank's slice (padding columns
    dropped). Costs a gather of the whole ``[..., V]`` tensor: for
    inspection and generation, not for the loss."""
    info = shard_info(model)
    full = gather_from_tp(logits, info.group, dim=-1)
    return full[..., : info.vocab_size]


def full_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (its keys and layouts: ``Conv1D``
    transposed back, vocabulary padding dropped), gathered on every rank of
    the group; ``load_state_dict`` of the original model takes it. With
    ``grads=True``, the full gradients instead (zeros where none). A meta
    tensor (another pipeline stage's layer, held by none of these ranks)
    reads as zeros of its full shape."""
    info = shard_info(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        tensor = value
        if grads:
            grad = value.grad if isinstance(value, nn.Parameter) else None
            tensor = grad if grad is not None else torch.zeros_like(value)
        spec = info.specs.get(key)
        if value.is_meta:  # another pipeline stage's, held by no rank of this group
            world = dist.get_world_size(info.group)
            shape = full_shape(spec, value.shape, world) if spec is not None else value.shape
            out[key] = torch.zeros(shape, dtype=value.dtype)
            continue
        out[key] = (
            unshard_tensor(tensor, spec, info.group)
            if spec is not None
            else tensor.detach().clone()
        )
    return out


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
