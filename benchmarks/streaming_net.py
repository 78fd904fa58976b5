"""The small model of the Streaming DiLoCo numerics checks: `streaming_compare.py` runs it
against torchft, tests/unit/test_streaming.py against plain DiLoCo as fedtrain merges it. An
input layer, residual tanh blocks with block-shaped names (`blocks.<i>.`) for the fragments,
a head, and its regression loss. Torch only: it also runs in torchft's venv, which has no
fedtrain."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """Input layer, `blocks` residual tanh layers, head: block-shaped names for the fragments."""

    def __init__(self, blocks: int = 4, width: int = 20) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(h)


def mse(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean squared error of `model` on the batch `b` (inputs, targets)."""
    return (model(b[0]) - b[1]).pow(2).mean()
