"""The models ``pc-train`` and ``pc-estimate`` know: ``transformers`` causal
LMs by family and size (``gpt2-small``, ``llama-1b`` ..., and the
mixture-of-experts ``mixtral-tiny`` / ``-small`` / ``-8x7b``, the router's
auxiliary loss on), or a local config file / ``save_pretrained`` directory.

The small presets (``tiny``, ``small``, ``medium``) use a byte vocabulary
(256) so they train on the default corpus without a tokenizer; the
published sizes keep their real vocabulary and shapes, for estimates and
for GPU runs. Dropout is off in every preset, so runs are deterministic.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "FAMILIES",
    "MODEL_PRESETS",
    "ModelSpec",
    "build_model",
    "reads_pretrained_after_boost",
    "resolve_model",
]

FAMILIES = ("gpt2", "llama", "opt", "bloom")

# name -> (family, hidden, layers, heads, kv heads, ffn, vocab)
_SHAPES: dict[str, tuple[str, int, int, int, int, int, int]] = {
    **{
        f"{family}-{size}": (family, h, n, a, a // 2 if family == "llama" else a, 4 * h, 256)
        for family in FAMILIES
        for size, (h, n, a) in {
            "tiny": (64, 2, 4),
            "small": (128, 4, 4),
            "medium": (256, 6, 8),
        }.items()
    },
    "gpt2-124m": ("gpt2", 768, 12, 12, 12, 3072, 50257),
    "gpt2-355m": ("gpt2", 1024, 24, 16, 16, 4096, 50257),
    "gpt2-774m": ("gpt2", 1280, 36, 20, 20, 5120, 50257),
    "gpt2-1.5b": ("gpt2", 1600, 48, 25, 25, 6400, 50257),
    "llama-1b": ("llama", 2048, 16, 32, 8, 8192, 128256),
    "llama-7b": ("llama", 4096, 32, 32, 32, 11008, 32000),
    "llama-13b": ("llama", 5120, 40, 40, 40, 13824, 32000),
    "opt-125m": ("opt", 768, 12, 12, 12, 3072, 50272),
    "opt-1.3b": ("opt", 2048, 24, 32, 32, 8192, 50272),
    "bloom-560m": ("bloom", 1024, 24, 16, 16, 4096, 250880),
}
# Mixture-of-experts presets: name -> (hidden, layers, heads, kv heads,
# expert ffn, vocab, experts, experts per token); Mixtral's own layout.
_MOE_SHAPES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "mixtral-tiny": (64, 2, 4, 2, 128, 256, 4, 2),
    "mixtral-small": (128, 4, 4, 2, 256, 256, 8, 2),
    "mixtral-8x7b": (4096, 32, 32, 8, 14336, 32000, 8, 2),
}
MODEL_PRESETS: tuple[str, ...] = (*_SHAPES, *_MOE_SHAPES)


@dataclass(frozen=True)
class ModelSpec:
    """A model to build: a ``transformers`` config, and a directory of
    pretrained weights to load into it (None: random initialisation)."""

    name: str
    config: Any  # transformers.PretrainedConfig
    pretrained: Path | None = None

    @property
    def family(self) -> str:
        return str(self.config.model_type)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden(self) -> int:
        return int(getattr(self.config, "hidden_size", getattr(self.config, "n_embd", 0)))

    @property
    def layers(self) -> int:
        return int(getattr(self.config, "num_hidden_layers", getattr(self.config, "n_layer", 0)))

    @property
    def heads(self) -> int | None:
        value = getattr(self.config, "num_attention_heads", getattr(self.config, "n_head", None))
        return int(value) if value is not None else None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "pc-train needs transformers, one of its dependencies: pip install transformers "
            "(or reinstall pc-train)."
        ) from None
    return transformers


def _moe_config(name: str, seq_len: int) -> Any:
    h, n, a, kv, ffn, vocab, experts, top = _MOE_SHAPES[name]
    return _transformers().MixtralConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=n,
        num_attention_heads=a, num_key_value_heads=kv, max_position_embeddings=max(seq_len, 1024),
        num_local_experts=experts, num_experts_per_tok=top, output_router_logits=True,
        router_aux_loss_coef=0.01, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, use_cache=False,
    )  # fmt: skip


def _preset_config(name: str, seq_len: int) -> Any:
    if name in _MOE_SHAPES:
        return _moe_config(name, seq_len)
    tf = _transformers()
    family, h, n, a, kv, ffn, vocab = _SHAPES[name]
    positions = max(seq_len, 1024 if vocab > 256 else seq_len)
    if family == "gpt2":
        return tf.GPT2Config(
            vocab_size=vocab, n_positions=positions, n_embd=h, n_layer=n, n_head=a,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family == "llama":
        return tf.LlamaConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=n,
            num_attention_heads=a, num_key_value_heads=kv, max_position_embeddings=positions,
            tie_word_embeddings=vocab <= 256, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )  # fmt: skip
    if family == "opt":
        return tf.OPTConfig(
            vocab_size=vocab, hidden_size=h, ffn_dim=ffn, num_hidden_layers=n,
            num_attention_heads=a, max_position_embeddings=positions, word_embed_proj_dim=h,
            dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1,
        )  # fmt: skip
    return tf.BloomConfig(
        vocab_size=vocab, hidden_size=h, n_layer=n, n_head=a, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=3,
    )  # fmt: skip


def resolve_model(model: str, seq_len: int) -> ModelSpec:
    """A preset name, a config ``.json`` file, or a directory with a
    ``config.json`` (and weights, which are then loaded)."""
    if model in MODEL_PRESETS:
        return ModelSpec(model, _preset_config(model, seq_len))
    path = Path(model)
    looks_like_path = path.suffix == ".json" or "/" in model or path.exists()
    if not looks_like_path:
        raise ValueError(
            f"unknown model {model!r}: expected a preset ({', '.join(MODEL_PRESETS)}), a "
            "config .json file, or a directory saved with save_pretrained."
        )
    config_file = path / "config.json" if path.is_dir() else path
    if path.is_file() and path.suffix in _WEIGHT_FILES:  # never read: it may be a pickle
        raise ValueError(
            f"model {model!r}: {path} is a weights file, not a config; pass the directory "
            f"that holds it with its config.json (save_pretrained writes both), or a config "
            ".json file."
        )
    if not config_file.is_file():
        raise ValueError(
            f"model {model!r}: {config_file} does not exist; pass a config .json file or a "
            "directory holding config.json (save_pretrained writes one)."
        )
    try:
        fields = json.loads(config_file.read_text())
        config = _transformers().AutoConfig.for_model(**fields)
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        raise ValueError(
            f"model {model!r}: {config_file} is not a usable config: {error}"
        ) from None
    weights = path.is_dir() and any(
        (path / name).exists()
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    )
    if weights:  # a pickle named in the safetensors index is refused, naming it
        from pc_booster.checkpoint.files import check_index_names

        check_index_names(path)
    return ModelSpec(str(path), config, path if weights else None)


# Files of weights, not configs: --model names their directory.
_WEIGHT_FILES = (".bin", ".pt", ".pth", ".ckpt", ".safetensors")


def _from_pretrained(path: Path) -> nn.Module:
    """``from_pretrained`` of ``path``; a pickle there that names code
    (torch's weights-only unpickler refuses it) is refused naming the file."""
    try:
        model: nn.Module = _transformers().AutoModelForCausalLM.from_pretrained(str(path))
    except pickle.UnpicklingError as error:
        from pc_booster.checkpoint import refuse_weights_only

        raise refuse_weights_only(error, str(_refused_file(path))) from None
    return model


def _refused_file(path: Path) -> Path:
    """Which pickle of ``path``'s weights torch's weights-only unpickler
    refuses (its directory when none alone is)."""
    names = {"pytorch_model.bin"}
    try:
        index = json.loads((path / "pytorch_model.bin.index.json").read_text())
        names = set(index["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    for name in sorted(names):
        if "/" in name or name in (".", ".."):  # only files of path itself are read
            continue
        try:
            torch.load(path / name, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:
            return path / name
        except Exception:  # missing, truncated: not the one refused
            continue
    return path


def build_model(
    spec: ModelSpec, seed: int, device: torch.device | str = "cpu", lazy: bool = False
) -> nn.Module:
    """The causal LM of ``spec``, its random weights drawn from ``seed``
    (the same on every rank), or loaded from its pretrained directory.
    ``lazy``: built under ``pc_chunk.LazyInitContext``, which allocates
    nothing; ``Booster.boost`` then materialises only each rank's share,
    with the values eager construction gives, and a pretrained
    directory's safetensors are read after boost, each rank its slices
    (:func:`reads_pretrained_after_boost`)."""
    tf = _transformers()
    if spec.pretrained is not None and not (lazy and reads_pretrained_after_boost(spec)):
        return _causal_loss(_from_pretrained(spec.pretrained)).to(device)
    torch.manual_seed(seed)
    context: Any = torch.device(device)
    if lazy:
        from pc_chunk import LazyInitContext

        context = LazyInitContext()
    with context:
        try:
            model = tf.AutoModelForCausalLM.from_config(spec.config)
        except ValueError as error:
            raise ValueError(
                f"model {spec.name!r} ({spec.family}) is not a causal language model "
                f"transformers can build: {error}"
            ) from None
    return _causal_loss(model)


def reads_pretrained_after_boost(spec: ModelSpec) -> bool:
    """Whether ``spec``'s pretrained weights are safetensors, which
    ``Booster.load_model`` reads by slices into a sharded model (a
    ``pytorch_model.bin`` is loaded whole by ``from_pretrained``)."""
    path = spec.pretrained
    return path is not None and any(Path(path).glob("*.safetensors"))


def _causal_loss(model: nn.Module) -> nn.Module:
    # Said outright, so transformers does not warn that it guessed it.
    if getattr(model, "loss_type", None) is None:
        object.__setattr__(model, "loss_type", "ForCausalLM")
    return model
