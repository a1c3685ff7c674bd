"""Tiny models and batches for the ZeRO-3 tests: a CNN and transformers'
GPT-2, Llama and BERT built from configs (random weights, no dropout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pc_comm.testing import tiny_gpt2

VOCAB, SEQ = 97, 16


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(2, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(3, 8), ConvBlock(8, 8), ConvBlock(8, 16)])
        self.head = nn.Linear(16 * 4 * 4, 10)
        self.checkpointing = False

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
            if i:
                x = F.max_pool2d(x, 2)
        return F.cross_entropy(self.head(x.flatten(1)), labels)


def build(name: str, checkpointing: bool = False) -> nn.Module:
    """The same weights every call (seeded)."""
    torch.manual_seed(0)
    model: nn.Module
    if name == "cnn":
        cnn = TinyCNN()
        cnn.checkpointing = checkpointing
        return cnn
    import transformers

    if name == "gpt2":
        model = tiny_gpt2(VOCAB, SEQ)
    elif name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    elif name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(name)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    model.train()
    return model


def block_classes(name: str) -> set[type[nn.Module]]:
    if name == "cnn":
        return {ConvBlock}
    import transformers.models.bert.modeling_bert as bert
    import transformers.models.gpt2.modeling_gpt2 as gpt2
    import transformers.models.llama.modeling_llama as llama

    return {
        "gpt2": {gpt2.GPT2Block},
        "llama": {llama.LlamaDecoderLayer},
        "bert": {bert.BertLayer},
    }[name]


def batch(name: str, step: int, size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "cnn":
        return {
            "x": torch.randn(size, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 10, (size,), generator=gen),
        }
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def loss_of(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    out = model(**inputs)
    loss: torch.Tensor = out if isinstance(out, torch.Tensor) else out.loss
    return loss


def rank_slice(inputs: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    n = next(iter(inputs.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in inputs.items()}


def param_groups(named: list[tuple[str, nn.Parameter]], lr: float) -> list[dict[str, Any]]:
    """Two groups, as users write them, by name (wrapped parameters are flat
    shards): no weight decay on biases and norms."""

    def no_decay(name: str) -> bool:
        return name.endswith("bias") or "norm" in name or ".ln" in name

    decay = [p for n, p in named if not no_decay(n)]
    rest = [p for n, p in named if no_decay(n)]
    return [
        {"params": decay, "weight_decay": 0.01},
        {"params": rest, "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def make_optimizer(kind: str, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    # eps=1e-6: some gradients are exactly zero in exact arithmetic (a key
    # bias under softmax), so both runs hold only rounding noise there, which
    # Adam's default eps=1e-8 would turn into full lr-sized steps of random sign.
    return torch.optim.AdamW(groups, lr=lr, eps=1e-6)


OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def chunk_size_for(model: nn.Module, parts: int) -> int:
    """A Gemini chunk size that cuts ``model`` into about ``parts`` chunks
    (never below its largest parameter), a multiple of 64 x world size."""
    sizes = [p.numel() for p in model.parameters()]
    quantum = 64 * dist.get_world_size()
    size = max(max(sizes), sum(sizes) // parts)
    return -(-size // quantum) * quantum


def named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameter names as in the unwrapped model (a wrapper's ``module.`` dropped)."""
    return [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
