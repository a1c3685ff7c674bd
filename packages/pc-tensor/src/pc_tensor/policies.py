"""Where tensor parallelism cuts a model family: a :class:`Policy` names,
relative to a transformer block, the projections split by output features
(column) and by input features (row), the per-rank attributes of the
attention modules, and, for sequence parallelism, the modules whose input is
gathered along the sequence on entry.

Paths are attribute paths (``"attn.c_attn"``). ``blocks`` and ``embedding``
are relative to the model's ``base_model`` (``GPT2Model`` inside
``GPT2LMHeadModel``), so one policy serves every head class of a family.

Families whose ``transformers`` config carries a tensor-parallel plan
(``base_model_tp_plan``: Llama, Qwen2, Mistral, Gemma and about 150 more)
are sharded from it (:mod:`pc_tensor.plans`); the hand-written policies here
cover four families without one (GPT-2, BERT, OPT, Bloom). They
follow the Megatron-LM layout: attention heads are
split across ranks (query, key and value by heads, the output projection by
its input), and so is each MLP (the up projections by output, the down
projection by input). Each block then costs two all-reduces forward and two
backward, or under sequence parallelism an all-gather and a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["POLICIES", "Policy"]


@dataclass(frozen=True)
class Policy:
    """How to shard one model family (see the module docstring).

    - ``column``: block path -> number of fused parts (GPT-2's ``c_attn``
      stacks q, k and v: 3), each split by output features.
    - ``row``: block paths split by input features.
    - ``heads``: block path of an attention module -> its integer attributes
      that count this rank's share (number of heads, width), divided by tp.
    - ``head_counts``: config fields tp must divide (heads, key/value heads).
    - ``gather_at``: under sequence parallelism, block paths of modules that
      read the sequence length from their input (attention, a gated MLP):
      their input is gathered on entry, once for every column layer inside.
    - ``flat_tokens``: block paths of layers fed ``[tokens, features]``
      (the batch and sequence flattened): split along dim 0 under sequence
      parallelism.
    - ``lm_heads``: model class name -> path of its vocabulary projection,
      sharded by vocabulary with its loss routed through
      :func:`~pc_tensor.vocab_parallel_cross_entropy`.
    - ``loss``: ``"causal"`` (shifted next-token) or ``"masked"``.
    - ``check``: returns an error message for a config the policy cannot
      shard, else None.
    - ``prepare_attention``: called on each module of ``heads`` with the
      group, for per-head inputs computed outside the block (Bloom's ALiBi).
    - ``gather_output``: column paths whose output is gathered whole (a
      fused projection split afterwards in a layout of its own).
    - ``split_input``: row paths that take the whole input and split it.
    - ``grad_sum``: block paths of modules kept whole on every rank whose
      gradients are summed over the group (a norm applied to local heads).
    """

    name: str
    blocks: str
    embedding: str
    column: Mapping[str, int]
    row: tuple[str, ...]
    heads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    head_counts: tuple[str, ...] = ()
    gather_at: tuple[str, ...] = ()
    flat_tokens: tuple[str, ...] = ()
    lm_heads: Mapping[str, str] = field(default_factory=dict)
    loss: Literal["causal", "masked"] = "causal"
    check: Callable[[Any], str | None] | None = None
    prepare_attention: Callable[[nn.Module, dist.ProcessGroup], None] | None = None
    gather_output: tuple[str, ...] = ()
    split_input: tuple[str, ...] = ()
    grad_sum: tuple[str, ...] = ()


def _gpt2_check(config: Any) -> str | None:
    if getattr(config, "add_cross_attention", False):
        return "GPT-2 with add_cross_attention=True is not supported (its q_attn is not sharded)."
    return None


def _bloom_check(config: Any) -> str | None:
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        return (
            "Bloom with slow_but_exact=True and pretraining_tp > 1 splits its projections "
            "itself; set slow_but_exact=False to shard it."
        )
    return None


def _bloom_slice_alibi(attention: nn.Module, group: dist.ProcessGroup) -> None:
    """BloomModel builds ALiBi for every head, ``[batch * heads, 1, keys]``;
    each rank keeps the rows of its own heads."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        alibi = kwargs.get("alibi")
        attention: Any = module
        if isinstance(alibi, torch.Tensor):
            local = int(attention.num_heads)
            heads = local * world
            shaped = alibi.view(-1, heads, *alibi.shape[1:])
            mine = shaped[:, rank * local : (rank + 1) * local]
            kwargs["alibi"] = mine.reshape(-1, *alibi.shape[1:])
        return args, kwargs

    attention.register_forward_pre_hook(hook, with_kwargs=True)


POLICIES: dict[str, Policy] = {
    "gpt2": Policy(
        name="gpt2",
        blocks="h",
        embedding="wte",
        column={"attn.c_attn": 3, "mlp.c_fc": 1},
        row=("attn.c_proj", "mlp.c_proj"),
        heads={"attn": ("num_heads", "split_size", "embed_dim")},
        head_counts=("n_head",),
        gather_at=("attn",),
        lm_heads={"GPT2LMHeadModel": "lm_head"},
        check=_gpt2_check,
    ),
    "bert": Policy(
        name="bert",
        blocks="encoder.layer",
        embedding="embeddings.word_embeddings",
        column={
            "attention.self.query": 1,
            "attention.self.key": 1,
            "attention.self.value": 1,
            "intermediate.dense": 1,
        },
        row=("attention.output.dense", "output.dense"),
        heads={"attention.self": ("num_attention_heads", "all_head_size")},
        head_counts=("num_attention_heads",),
        gather_at=("attention.self",),
        lm_heads={"BertForMaskedLM": "cls.predictions.decoder"},
        loss="masked",
    ),
    "opt": Policy(
        name="opt",
        blocks="decoder.layers",
        embedding="decoder.embed_tokens",
        column={"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "fc1": 1},
        row=("self_attn.out_proj", "fc2"),
        heads={"self_attn": ("num_heads",)},
        head_counts=("num_attention_heads",),
        gather_at=("self_attn",),
        flat_tokens=("fc1", "fc2"),
        lm_heads={"OPTForCausalLM": "lm_head"},
    ),
    "bloom": Policy(
        name="bloom",
        blocks="h",
        embedding="word_embeddings",
        column={"self_attention.query_key_value": 1, "mlp.dense_h_to_4h": 1},
        row=("self_attention.dense", "mlp.dense_4h_to_h"),
        heads={"self_attention": ("num_heads",)},
        head_counts=("n_head",),
        gather_at=("self_attention",),
        lm_heads={"BloomForCausalLM": "lm_head"},
        check=_bloom_check,
        prepare_attention=_bloom_slice_alibi,
    ),
}
