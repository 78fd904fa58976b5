"""What the Streaming DiLoCo tests share: a regression task with its own generator, and a
run config whose rounds wait for both participants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests.helpers.config import tiny_config
from tests.helpers.tiny import Regression, Setup, Small


@dataclass(frozen=True)
class Fixed(Regression):
    """`Regression`, its batch drawn from a generator of its own: participants build their tasks
    on threads of their own at once, and torch's global RNG is shared between those threads."""

    def build(self, run: Any = None) -> Setup:
        assert self.seed is not None
        x = torch.randn(self.rows, 3, generator=torch.Generator().manual_seed(self.seed))
        y = x.sum(dim=1, keepdim=True)
        model = Small()  # (its weights are the coordinator's from the join on)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=self.lr), lambda: (x, y),
                     lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), lambda b: self.rows)


def streaming_config(rounds: int, sync_every: int, streaming: dict[str, Any], **over: Any) -> Any:
    """Rounds wait for both participants (min_participants 2): one that joins late would miss round 0.
    The outer lr is torchft's 0.7, which `simulate` runs with."""
    return tiny_config(rounds=rounds, train={"sync_every": sync_every, **over.pop("train", {})},
                       streaming=streaming, min_participants=2, outer={"lr": 0.7, **over.pop("outer", {})}, **over)
