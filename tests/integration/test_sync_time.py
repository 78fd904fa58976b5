"""`fed.history`'s sync time counts every attempt of a round (issue #34: a 66 s round reported
32 s, its failed attempts left out): an attempt that fails (the link is down) and the one
that syncs after it both count, and the record says how many there were."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import CoordinatorUnavailable
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.participant.engine.outage import OutagePolicy
from fedtrain.wire import write_file
from tests.helpers.config import PTOKEN, tiny_config

FAILED_S = 0.3  # how long the failed attempt tries before it gives up


class DownOnce(CoordinatorClient):
    """A client whose first upload finds the link down: it tries for FAILED_S and gives up."""

    failures = 1

    def upload(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.failures:
            self.failures -= 1
            time.sleep(FAILED_S)
            raise CoordinatorUnavailable("the link is down (test)", status=0, code="unavailable")
        return super().upload(*args, **kwargs)


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))


def test_the_sync_time_of_a_round_counts_its_failed_attempts(tmp_path: Path) -> None:
    init = tmp_path / "init.safetensors"
    write_file(init, {"w": torch.zeros(4)})
    cfg = tiny_config(rounds=1, train={"sync_every": 2}, outer={"algorithm": "fedavg"})
    outage = OutagePolicy(budget_s=60, attempt_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.1)
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init) as c:
        model = One()
        with Participant(DownOnce(c.url, PTOKEN), model=model, name="solo", outage=outage) as fed:
            while not fed.finished:
                with torch.no_grad():
                    model.w.add_(1.0)
                fed.step(tokens=1)
        record = fed.history[0]
    assert record["round"] == 0
    assert record["sync_attempts"] == 2
    # the failed attempt's time is in (it lasted FAILED_S at least, by construction)
    assert record["sync_s"] >= FAILED_S
    assert fed.sync_seconds >= record["sync_s"]
