"""A tensor-parallel :class:`~pc_tensor.policies.Policy` inferred from a
model's module tree, for a ``transformers`` family with neither a plan in
its config (``base_model_tp_plan``) nor a pc policy: ViT, DeiT, Dinov2,
CLIP's and SigLIP's vision towers, RoBERTa and the other encoders written
in the same shape.

What is inferred (paths relative to ``model.base_model``):

- the block list: the one ``nn.ModuleList`` of blocks of one type whose
  blocks hold an attention's query, key and value projections;
- in each block, the attention's ``q_proj|k_proj|v_proj|query|key|value``
  column-parallel and its output projection (``o_proj|out_proj``, or
  ``dense`` in a submodule named ``output`` of the attention) row-parallel;
  the MLP's up projections (``up_proj|gate_proj|fc1|c_fc``,
  ``intermediate.dense``) column-parallel and its down projection
  (``down_proj|fc2|c_proj``, the block's ``output.dense``) row-parallel;
- the attention module's integer attributes that count its heads or its
  width (equal to a head count of the config or to a projection's output
  features), divided by tp.

Everything else (embeddings, patch embeddings, norms, layer scales, the
pooler, the classifier) stays whole on every rank: the token embedding is
not split by vocabulary, and no head is treated as an LM head.

Refused, with what was expected and the fix: no block list or several
(Swin's stages, an encoder-decoder such as Whisper, CLIP's two towers),
blocks that differ, a block without the four attention projections or the
MLP's up and down, a fused query/key/value projection (its layout, stacked
or interleaved by head, is not in the module tree), a projection that is
not ``nn.Linear`` (or GPT-2's ``Conv1D``), parameters inside the attention
or between the MLP's projections that would see this rank's heads or
features only (a relative-position bias per head, a per-head norm), and
per-head parameters anywhere else (BEiT's relative-position biases), and
blocks that rebuild their attention from the config while running
(BigBird's ``set_attention_type``, which swaps block-sparse attention for
full attention on a short sequence with the config's whole head count).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from pc_tensor.plans import has_plan, policy_for
from pc_tensor.policies import POLICIES, Policy

__all__ = ["infer_plan", "policy_or_inferred"]

_QKV = {"q_proj": "q", "query": "q", "k_proj": "k", "key": "k", "v_proj": "v", "value": "v"}
_FUSED = ("qkv", "qkv_proj", "query_key_value", "c_attn", "wqkv", "in_proj")
_OUT = ("o_proj", "out_proj")
_UP = ("up_proj", "gate_proj", "fc1", "c_fc")
_DOWN = ("down_proj", "fc2", "c_proj")
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
# Integer attributes of an attention module that may equal a head count or
# a width by chance and must not be divided (the size of one head, a layer
# index, the query-to-key/value ratio).
_NOT_COUNTS = re.compile(
    r"head_dim|(?<!all_)head_size|groups|idx|window|patch|position|bucket|scal"
)


def _config_counts(config: Any) -> dict[str, int]:
    """The config's head counts that are integers (transformers raises for
    a global read of a per-layer field: skipped)."""
    counts = {}
    for name in _HEAD_COUNTS:
        try:
            value = getattr(config, name, None)
        except Exception:
            continue
        if type(value) is int:
            counts[name] = value
    return counts


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


def _is_projection(module: nn.Module) -> bool:
    return type(module) is nn.Linear or type(module).__name__ == "Conv1D"


def _out_features(module: nn.Module) -> int:
    weight: Any = module.weight
    return int(weight.shape[1] if type(module).__name__ == "Conv1D" else weight.shape[0])


def _in_features(module: nn.Module) -> int:
    weight: Any = module.weight
    return int(weight.shape[0] if type(module).__name__ == "Conv1D" else weight.shape[1])


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _block_lists(base: nn.Module) -> list[str]:
    """Paths of the module lists whose entries are all of one type and hold
    an attention's query, key and value projections (fused or not)."""
    found = []
    for path, module in base.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        names = {_leaf(p).lower() for p, _ in module[0].named_modules()}
        if names & {*_QKV, *_FUSED}:
            found.append(path)
    return found


def _layout(block: nn.Module) -> list[tuple[str, str, tuple[tuple[int, ...], ...]]]:
    """What must match across blocks: the modules holding parameters and
    their shapes (a drop-path that is ``Identity`` in the first block only
    does not count)."""
    return [
        (path, type(module).__name__, tuple(tuple(p.shape) for p in module.parameters(False)))
        for path, module in block.named_modules()
        if _holds_params(module)
    ]


class _Refusal:
    """Builds the refusals' messages: the model, what pc expected, what it
    found, and the way out."""

    def __init__(self, model: nn.Module) -> None:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        self.prefix = f"{type(model).__name__} (model_type={kind!r})"

    def __call__(self, found: str, fix: str = "") -> ValueError:
        fix = fix or (
            "describe the sharding with pc_tensor.Policy and pass shard_model(model, group, "
            "policy=...), or train it with data parallelism, ZeRO or a pipeline"
        )
        return ValueError(
            f"{self.prefix} has no tensor-parallel plan, so pc infers one from its module tree "
            f"(one list of identical blocks, each with q/k/v and output attention projections "
            f"and an MLP's up and down projections, all nn.Linear), but {found}. Fix: {fix}."
        )


def _find_attention(block: nn.Module, refuse: _Refusal, where: str) -> tuple[str, list[str]]:
    """The attention module's path in the block and its q, k, v paths."""
    modules = dict(block.named_modules())
    fused = [p for p in modules if p and _leaf(p).lower() in _FUSED]
    if fused:
        raise refuse(
            f"{where}.0.{fused[0]} is a fused query/key/value projection, whose layout (q, k and v "
            "stacked, or interleaved head by head) the module tree does not say",
            "if q, k and v are stacked, pass a pc_tensor.Policy with column={"
            f"{fused[0]!r}: 3}} to shard_model(model, group, policy=...)",
        )
    qkv = [p for p in modules if p and _leaf(p) in _QKV]
    parents = {p.rpartition(".")[0] for p in qkv}
    kinds = sorted(_QKV[_leaf(p)] for p in qkv)
    if len(parents) != 1 or kinds != ["k", "q", "v"]:
        raise refuse(
            f"the blocks of {where} hold query/key/value projections {qkv or 'none'} (expected "
            "one of each, in one attention module: a block with cross-attention or several "
            "attentions is not inferred)"
        )
    return parents.pop(), sorted(qkv, key=lambda p: "qkv".index(_QKV[_leaf(p)]))


def _find_output(block: nn.Module, attention: str, refuse: _Refusal, where: str) -> tuple[str, str]:
    """The attention's output projection, searched in the attention module
    and then in its parent (BERT's ``attention.output.dense`` beside
    ``attention.self``); returns it and the module it was found in."""
    modules = dict(block.named_modules())
    scopes = [attention]
    if "." in attention:  # never the whole block: its output.dense is the MLP's down
        scopes.append(attention.rpartition(".")[0])
    for scope in scopes:
        outs = [
            p
            for p in modules
            if p != scope
            and _under(p, scope)
            and (_leaf(p) in _OUT or (bool(scope) and p.endswith("output.dense")))
        ]
        if len(outs) == 1:
            return outs[0], scope
        if len(outs) > 1:
            raise refuse(f"the attention of {where} has several output projections {outs}")
    raise refuse(
        f"the attention {where}.0.{attention} has no output projection (o_proj, out_proj, or "
        "output.dense beside it)"
    )


def _find_mlp(
    modules: dict[str, nn.Module], skip: str, refuse: _Refusal, where: str
) -> tuple[list[str], str]:
    """The MLP's up projections and its down projection, outside the
    attention module ``skip``."""
    mlp = [p for p in modules if p and not _under(p, skip)]
    ups = [p for p in mlp if _leaf(p) in _UP or p.endswith("intermediate.dense")]
    downs = [p for p in mlp if _leaf(p) in _DOWN or p.endswith("output.dense")]
    if not ups or len(ups) > 2 or len(downs) != 1:
        raise refuse(
            f"the MLP of {where}'s blocks has up projections {ups or 'none'} and down "
            f"projections {downs or 'none'} (expected one or two up: up_proj, gate_proj, fc1, "
            "c_fc, intermediate.dense; and one down: down_proj, fc2, c_proj, output.dense)"
        )
    return ups, downs[0]


def _check_projections(
    modules: dict[str, nn.Module],
    pairs: list[tuple[str, str]],
    refuse: _Refusal,
    where: str,
) -> None:
    """Each (column, row) pair is two ``nn.Linear`` (or ``Conv1D``), the
    first's output the second's input; and nothing else with parameters
    sits inside the modules holding the column layers, where it would see
    this rank's heads or features only."""
    split = {p for pair in pairs for p in pair}
    for path in sorted(split):
        if not _is_projection(modules[path]):
            raise refuse(
                f"{where}.0.{path} is {type(modules[path]).__name__}, not nn.Linear",
                "replace it with nn.Linear, or describe the sharding with pc_tensor.Policy",
            )
    for column, row in pairs:
        given, taken = _out_features(modules[column]), _in_features(modules[row])
        if given != taken:
            raise refuse(f"{where}.0.{column} gives {given} features and {row} takes {taken}")
    for parent in {column.rpartition(".")[0] for column, _ in pairs}:
        for path, module in modules.items():
            inside = _under(path, parent) and not any(_under(path, p) for p in split)
            if inside and _holds_params(module):
                raise refuse(
                    f"{where}.0.{path} ({type(module).__name__}) holds parameters inside "
                    f"{where}.0.{parent or '(the block)'}, where it would see this rank's "
                    "heads or features only"
                )


def _head_attributes(
    owner: nn.Module, counts: set[int], refuse: _Refusal, where: str
) -> tuple[str, ...]:
    """The attention module's integer attributes that count its heads or
    its width: equal to a config head count or a projection's width."""
    heads = tuple(
        name
        for name, value in vars(owner).items()
        if type(value) is int and value in counts and not _NOT_COUNTS.search(name)
    )
    if not heads:
        raise refuse(
            f"{where} ({type(owner).__name__}) has no integer attribute counting its heads "
            f"(expected one equal to a config head count or a projection's width: {sorted(counts)})"
        )
    return heads


def _check_no_per_head_parameters(
    model: nn.Module, sharded: set[int], heads: set[int], refuse: _Refusal
) -> None:
    """A parameter outside the split projections with one value per head
    (a relative-position bias table ``[distances, heads]``) would have to be
    split with the heads."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd) or _is_projection(module):
            continue  # a patch embedding's kernel is not per head
        for pname, param in module.named_parameters(recurse=False):
            if id(param) not in sharded and param.dim() >= 2 and param.shape[-1] in heads:
                raise refuse(
                    f"{name}.{pname} {tuple(param.shape)} holds a value per attention head, "
                    "which tensor parallelism would have to split with the heads",
                    "turn it off in the config where it is optional (BEiT's "
                    "use_relative_position_bias, use_shared_relative_position_bias), or "
                    "train the model with data parallelism, ZeRO or a pipeline",
                )


# Methods by which a block replaces its attention module while the model
# runs, building the new one from the config (whose head count is the
# whole model's): the split head count would be lost.
_REBUILDS = ("set_attention_type",)


def _check_not_rebuilt(modules: dict[str, nn.Module], refuse: _Refusal, where: str) -> None:
    for path, module in modules.items():
        for method in _REBUILDS:
            if callable(getattr(module, method, None)):
                raise refuse(
                    f"{'.'.join([where, '0', path]).rstrip('.')} ({type(module).__name__}) has "
                    f"{method}(), by which the model replaces its attention while it runs with "
                    "one built from the config, whose head count is the whole model's, not this "
                    "rank's",
                    "train it with data parallelism, ZeRO or a pipeline",
                )


def infer_plan(model: nn.Module, tp_size: int | None = None) -> Policy:
    """The :class:`Policy` inferred from ``model``'s module tree (see the
    module docstring). Raises ``ValueError`` naming what pc expected and
    found where the model does not fit the pattern; with ``tp_size``, also
    where tp does not divide the heads (``shard_model`` checks that in any
    case)."""
    refuse = _Refusal(model)
    config: Any = getattr(model, "config", None)
    base: nn.Module = getattr(model, "base_model", model)
    lists = _block_lists(base)
    if len(lists) != 1:
        raise refuse(
            f"it has {len(lists)} such block lists ({', '.join(lists)})"
            if lists
            else "no nn.ModuleList of blocks holds projections named q_proj, k_proj, v_proj "
            "(or query, key, value)",
            "shard one tower or stack at a time with a pc_tensor.Policy naming its block list"
            if lists
            else "",
        )
    where = lists[0]
    stack = base.get_submodule(where)
    assert isinstance(stack, nn.ModuleList)
    blocks = list(stack)
    layout = _layout(blocks[0])
    for index, other in enumerate(blocks[1:], start=1):
        if _layout(other) != layout:
            raise refuse(f"{where}.{index} differs from {where}.0 in its modules or shapes")
    modules = dict(blocks[0].named_modules())
    _check_not_rebuilt(modules, refuse, where)
    attention, qkv = _find_attention(blocks[0], refuse, where)
    out, scope = _find_output(blocks[0], attention, refuse, where)
    ups, down = _find_mlp(modules, scope, refuse, where)
    _check_projections(
        modules, [*((p, out) for p in qkv), *((u, down) for u in ups)], refuse, where
    )
    config_counts = _config_counts(config)
    head_counts = set(config_counts.values())
    owner = modules[attention]
    heads = _head_attributes(
        owner,
        head_counts | {_out_features(modules[p]) for p in qkv},
        refuse,
        f"{where}.0.{attention}",
    )
    sharded = {
        id(p)
        for b in blocks
        for path in (*qkv, *ups, out, down)
        for p in b.get_submodule(path).parameters()
    }
    head_counts.update(getattr(owner, h) for h in heads if h.endswith(("heads", "head")))
    _check_no_per_head_parameters(model, sharded, head_counts, refuse)
    if tp_size is not None:
        for name in heads:
            value = int(getattr(owner, name))
            if value % tp_size:
                fits = [d for d in range(1, value + 1) if value % d == 0]
                raise refuse(
                    f"{where}.0.{attention}.{name} = {value} is not divisible by the tensor-"
                    f"parallel size {tp_size}",
                    f"use a tp size that divides it ({fits})",
                )
    kind = getattr(config, "model_type", None) or type(model).__name__
    return Policy(
        name=f"{kind} (inferred)",
        blocks=where,
        embedding="",  # no token embedding is split: it stays whole on every rank
        column=dict.fromkeys([*qkv, *ups], 1),
        row=(out, down),
        heads={attention: heads},
        head_counts=tuple(config_counts),
        gather_at=tuple(sorted({p.rpartition(".")[0] for p in (*qkv, *ups)} - {""})),
    )


def policy_or_inferred(model: nn.Module) -> Policy:
    """The policy :func:`~pc_tensor.shard_model` uses by default: the
    family's transformers plan, else pc's hand-written policy, else the
    plan :func:`infer_plan` reads from the module tree."""
    try:
        return policy_for(model)
    except ValueError as no_policy:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        if has_plan(model) or kind in POLICIES:
            raise
        try:
            return infer_plan(model)
        except ValueError as not_inferred:
            raise ValueError(f"{no_policy} {not_inferred}") from None
