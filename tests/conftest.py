"""Shared fixtures: tiny run configs and a coordinator on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator

PTOKEN = "participant-token"
ATOKEN = "admin-token"


def tiny_config(**overrides: object) -> RunConfig:
    data: dict = {
        "name": "test",
        "rounds": 3,
        "train": {"sync_every": 5, "seq_len": 32, "batch_size": 8, "eval_batches": 2, "lr": 3e-3},
        "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 20.0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RunConfig.model_validate(data)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c:
        yield c
