"""The tokens and the tiny run config every test builds on, and the mark that runs a module's
tests once per transport (fast IO on and off: the `transport` fixture of tests/conftest.py)."""

from __future__ import annotations

import pytest

from fedtrain.config import RunConfig

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


BOTH_TRANSPORTS = pytest.mark.usefixtures("transport")
"""`pytestmark = BOTH_TRANSPORTS`: every test of a module runs once per transport (`transport`)."""
