"""An in-process `Coordinator`'s intake, as the unit tests of its receive paths drive it
(`receive_update`, `receive_part`): random updates shaped like the model, and the running sum
that folding them (10 tokens each) into an empty round must give."""

from __future__ import annotations

import torch

from fedtrain.coordinator import Coordinator
from fedtrain.merge import RunningSum


def updates(svc: Coordinator, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n random updates with the model's names and shapes, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g) for k, v in svc.inspect().weights.items()} for _ in range(n)]


def expected_sum(svc: Coordinator, *updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What folding `updates` (10 tokens each) into an empty sum gives."""
    ref = RunningSum(svc.inspect().weights)
    for u in updates:
        ref.add(u, 10.0 if svc.config.outer.weighting == "tokens" else 1.0)
    return ref.peek()


def assert_sum_is(svc: Coordinator, *updates: dict[str, torch.Tensor]) -> None:
    """The open round's sum is exactly what folding `updates`, in this order, gives."""
    want = expected_sum(svc, *updates)
    got = svc.inspect().sum_values
    assert all(torch.equal(got[n], want[n]) for n in want)
