"""The small models and data the pipeline tests train."""

from __future__ import annotations

import torch
from torch import nn

from pc_pipeline import Sequential

WIDTH = 16


class Split(nn.Module):
    """Returns two tensors, so a stage boundary can carry a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.sigmoid(self.gate(x))


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x * gate)
        return out


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def build_model(seed: int = 0) -> Sequential:
    """Eight layers, so up to eight stages (4 ranks x 2 chunks)."""
    torch.manual_seed(seed)
    return Sequential(
        nn.Linear(8, WIDTH),
        Residual(),
        Split(),
        Merge(),
        Residual(),
        nn.Tanh(),
        Residual(),
        nn.Linear(WIDTH, 4),
    )


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = nn.functional.mse_loss(output, target)
    return loss
