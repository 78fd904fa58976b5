"""Central DP against a lying participant: the coordinator does not trust anyone's clipping. An
update sent through the real upload route with a norm far past C moves the model by at most C
(its clipped value, plus the round's noise); the privacy section's numbers are bounded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedtrain.config import parse_config
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import ConfigError
from tests.helpers.api import client, halves, put, send_piece, wait_round
from tests.helpers.config import tiny_config

pytest.importorskip("dp_accounting")


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def test_an_oversized_update_is_clipped_to_c_by_the_coordinator(tmp_path: Path) -> None:
    clip, sigma = 0.5, 0.01
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={"clip_norm": clip, "noise_multiplier": sigma})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "liar"})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        g = torch.Generator().manual_seed(1)
        lie = {n: torch.randn(t.shape, generator=g) for n, t in theta0.items()}  # norm ~ sqrt(params) >> C
        assert _norm(lie) > 100 * clip
        assert put(http, 0, "liar", lie).status_code == 200
        assert wait_round(http, 0)["state"] == "closed"
        theta1 = c.service.inspect().weights
        moved = {n: theta0[n] - theta1[n] for n in theta0}  # fedavg, lr 1: the noisy mean
        clipped = {n: lie[n] * (clip / _norm(lie)) for n in lie}
        params = sum(t.numel() for t in lie.values())
        noise = _norm({n: moved[n] - clipped[n] for n in lie})
        # What is left is the round's noise, N(0, (σ·1·C)²) per coordinate: its norm ≈ σ·C·√params
        # (the chi distribution at this size is within a few percent of that), nowhere near ‖lie‖.
        assert noise == pytest.approx(sigma * clip * math.sqrt(params), rel=0.1)
        assert _norm(moved) <= clip + 1.2 * sigma * clip * math.sqrt(params)


def test_an_update_in_pieces_is_clipped_as_a_whole(tmp_path: Path) -> None:
    """FSDP ranks send their rows as pieces without clipping them (a rank's rows are not the sync
    set): the coordinator clips the assembled update, over its whole norm, as it would one body."""
    clip, sigma = 0.5, 0.01
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={"clip_norm": clip, "noise_multiplier": sigma})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a", "info": {"parallel": "fsdp", "world_size": 2}})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        g = torch.Generator().manual_seed(2)
        big = {n: torch.randn(t.shape, generator=g) for n, t in theta0.items()}
        for label, (part, rows) in zip(("r0", "r1"), halves(big), strict=True):
            assert send_piece(http, "a", label, part, rows).status_code == 200
        assert wait_round(http, 0)["state"] == "closed"
        theta1 = c.service.inspect().weights
        clipped = {n: big[n] * (clip / _norm(big)) for n in big}
        params = sum(t.numel() for t in big.values())
        left = _norm({n: theta0[n] - theta1[n] - clipped[n] for n in big})
        assert left == pytest.approx(sigma * clip * math.sqrt(params), rel=0.1)  # the noise, nothing more


@pytest.mark.parametrize(
    ("field", "value"),
    [("clip_norm", 0), ("clip_norm", 1e7), ("noise_multiplier", 0), ("noise_multiplier", 1e4), ("delta", 0),
     ("delta", 0.5), ("epsilon_budget", -1), ("epsilon_budget", 1e7), ("accountant", "moments"),
     ("clip_norm", float("inf")), ("noise_multiplier", float("nan"))],
)
def test_privacy_numbers_are_bounded(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"privacy.{field}"):
        parse_config({"privacy": {field: value}})
