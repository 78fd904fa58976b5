"""The coordinator runs the outer lr the recommended table gives its config, and says which."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from tests.helpers.config import PTOKEN, tiny_config


@pytest.mark.parametrize("m,h,outer,lr", [(4, 30, {}, 0.85), (1, 5, {}, 0.4), (4, 30, {"lr": 0.25}, 0.25),
                                          (4, 30, {"algorithm": "fedavg"}, 1.0)])
def test_status_shows_the_outer_lr_in_force(tmp_path: Path, m: int, h: int, outer: dict, lr: float) -> None:
    cfg = tiny_config(min_participants=m, train={"sync_every": h}, outer=outer)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, CoordinatorClient(c.url, PTOKEN) as client:
        status = client.status()
    assert status["outer_lr"] == lr
    assert f"(outer lr {lr:g})" in format_status(status).splitlines()[0]
