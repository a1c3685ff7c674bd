"""The model families of the installed ``transformers`` that carry a
tensor-parallel plan, each built tiny from its config (hidden 64, 2 layers,
4 query heads over 2 key/value heads, vocabulary 131: padded to 132 at tp 2): the families the
plan sweep (``sweep.py``) and its sample test run."""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 64, 2, 4, 2, 131, 8

# Read from each config class's defaults and overridden with the tiny sizes.
_TINY: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HIDDEN // HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "rotary_dim": HIDDEN // HEADS // 2,  # GPT-J, CodeGen: partial rotary within a head
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attn_implementation": "eager",
    # Mixture-of-experts families: few, small experts (tensor parallelism
    # refuses them, but they are built to show that it does).
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": HIDDEN,
    "shared_expert_intermediate_size": HIDDEN,
}


class Skip(Exception):  # noqa: N818  (a result, not an error)
    """A family the sweep cannot build tiny, with the reason."""


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str
    tp_plan: dict[str, str]
    has_pp_plan: bool
    overrides: tuple[tuple[str, Any], ...] = ()  # config fields beside the tiny sizes
    variant: str = ""

    @property
    def name(self) -> str:
        return f"{self.model_type}+{self.variant}" if self.variant else self.model_type


# Families whose training is random by design, beyond dropout (which the
# sweep turns off): no two runs match, so parity cannot be asked of them.
STOCHASTIC: dict[str, str] = {
    "phimoe": "its router samples the experts while training (sparsemixer's torch.rand_like)",
}

# Variants a name can ask for: "llama+tied" is Llama with its LM head tied
# to the embedding (the tiny default unties every family's head).
VARIANTS: dict[str, dict[str, Any]] = {
    "tied": {"tie_word_embeddings": True},
    "gqa1": {"num_key_value_heads": 1},  # one key/value head: tp 2 refuses it
}


def family(name: str) -> Family:
    """A family by ``model_type``, with ``+variant`` (:data:`VARIANTS`)."""
    from dataclasses import replace

    model_type, _, variant = name.partition("+")
    known = [*families(), *families_without_plan()]
    found = next((f for f in known if f.model_type == model_type), None)
    if found is None:
        raise ValueError(f"no family {model_type!r} with a causal LM or a tp plan is installed")
    if variant:
        found = replace(found, overrides=tuple(VARIANTS[variant].items()), variant=variant)
    return found


@functools.cache
def families() -> list[Family]:
    """Every config class of the installed transformers with a
    ``base_model_tp_plan``, in name order."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type, class_name in sorted(CONFIG_MAPPING_NAMES.items()):
        cls = getattr(transformers, class_name, None)
        plan = getattr(cls, "base_model_tp_plan", None)
        if cls is None or not plan:
            continue
        pp = bool(getattr(cls, "base_model_pp_plan", None))
        out.append(Family(model_type, class_name, dict(plan), pp))
    return out


@functools.cache
def families_without_plan() -> list[Family]:
    """Every config class of the installed transformers with no
    ``base_model_tp_plan`` whose model has a causal-LM class, in name
    order: pc infers their tensor-parallel plan (``pc_tensor.infer_plan``)
    and cuts their pipeline from the module tree (the repeated blocks)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, class_name in sorted(CONFIG_MAPPING_NAMES.items()):
        cls = getattr(transformers, class_name, None)
        if cls is None or getattr(cls, "base_model_tp_plan", None):
            continue
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        pp = bool(getattr(cls, "base_model_pp_plan", None))
        out.append(Family(model_type, class_name, {}, pp))
    return out


def tiny_config(family: Family, **overrides: Any) -> Any:
    import transformers

    cls = getattr(transformers, family.config_class)
    values = {**_TINY, **overrides}
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        config = cls(**values)
    # Sizes some families keep under other names.
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:LAYERS]
    config._attn_implementation = "eager"
    if hasattr(config, "use_cache"):  # training: no key/value cache (hybrid linear-attention
        config.use_cache = False  # families' caches refuse a training forward)
    return config


def build(family: Family, head: str = "causal", seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny model of ``family`` with ``head`` (``causal``, ``sequence``,
    ``token``, or ``base``: the base model alone, for the text models of
    multimodal families that have no head class of their own), fp32, with
    dropout off."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    auto = {
        "base": AutoModel,
        "causal": AutoModelForCausalLM,
        "sequence": AutoModelForSequenceClassification,
        "token": AutoModelForTokenClassification,
    }[head]
    config = tiny_config(family, **{**dict(family.overrides), **overrides})
    if getattr(config, "sub_configs", None):
        raise Skip(
            "a composite config (its text model is a family of its own here); "
            f"sub-configs {sorted(config.sub_configs)}"
        )
    for name in dir(config):  # dropout off: parity needs the same forward everywhere
        if "dropout" in name or name.endswith("_pdrop"):
            value = getattr(config, name, None)
            if isinstance(value, float):
                with contextlib.suppress(Exception):
                    setattr(config, name, 0.0)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                shape = auto.from_config(config, attn_implementation="eager")
        except ValueError as error:
            if "Unrecognized configuration class" in str(error):
                raise Skip(f"transformers has no {auto.__name__} class for it") from None
            raise
        count = sum(p.numel() for p in shape.parameters())
        if count > 5_000_000:
            raise Skip(f"{count / 1e6:.0f} M parameters at the tiny sizes (a size pc did not set)")
        torch.manual_seed(seed)
        model: nn.Module = auto.from_config(config, attn_implementation="eager")
    return model.float()
