"""Offline stand-in for the torchvision (and timm) names the ported programs
use; torchvision is not installable here. ``datasets.CIFAR10`` and
``datasets.Caltech101`` give synthetic image tensors (fixed seed; the
training size of CIFAR10 is OFFLINE_CIFAR10_SIZE, default 1024),
``transforms`` are identities (the data is tensors already, and random crops
and flips would make the ranks' data differ from the reference's),
``models.resnet18``/``resnet34`` a tiny transformers ResNet and
``vit_base_patch16_224`` a tiny transformers ViT, both returning the logits."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import (
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

Transform = Callable[[torch.Tensor], torch.Tensor]


class _Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int, classes: int, seed: int, transform: Transform | None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(size, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def CIFAR10(  # noqa: N802  (torchvision's name)
    root: Any, train: bool = True, transform: Transform | None = None, download: bool = False
) -> _Images:
    size = int(os.environ.get("OFFLINE_CIFAR10_SIZE", "1024")) if train else 200
    return _Images(size, 10, 0 if train else 1, transform)


def Caltech101(  # noqa: N802  (torchvision's name)
    root: Any, download: bool = False, transform: Transform | None = None
) -> _Images:
    return _Images(512, 101, 2, transform)


class _Logits(nn.Module):
    """A transformers image classifier that returns the logits, as torchvision's do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(pixel_values=images).logits
        return logits


def resnet18(num_classes: int = 1000) -> nn.Module:
    config = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=num_classes,
    )
    return _Logits(ResNetForImageClassification(config))


resnet34 = resnet18


def vit_base_patch16_224(drop_rate: float = 0.0, num_classes: int = 101) -> nn.Module:
    config = ViTConfig(
        image_size=32,
        patch_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=drop_rate,
        attention_probs_dropout_prob=0.0,
        num_labels=num_classes,
    )
    return _Logits(ViTForImageClassification(config))


def _identity(*args: Any, **kwargs: Any) -> Transform:
    return lambda x: x


def _compose(steps: Sequence[Transform]) -> Transform:
    def apply(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return apply


transforms = SimpleNamespace(
    Compose=_compose,
    Pad=_identity,
    RandomHorizontalFlip=_identity,
    RandomCrop=_identity,
    RandomResizedCrop=_identity,
    Resize=_identity,
    ToTensor=_identity,
    Normalize=_identity,
)
datasets = SimpleNamespace(CIFAR10=CIFAR10, Caltech101=Caltech101)
models = SimpleNamespace(resnet18=resnet18, resnet34=resnet34)
