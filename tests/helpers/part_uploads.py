"""An update large enough to travel in several 1 MiB parts, as the integration tests of
uploads in parts send it: the run's config, the update, the model round 0 commits, and the
reference model an uninterrupted whole upload makes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.wire import EncodedBody
from tests.helpers.config import PTOKEN, tiny_config

PART = 1 << 20


def parts_config(**overrides: Any) -> RunConfig:
    """A run whose model is about 5.3 MB of fp32 weights: six parts of 1 MiB."""
    return tiny_config(model={"n_layer": 1, "n_embd": 320, "n_head": 2, "block_size": 32}, **overrides)


def delta_of(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    """The update every test sends: small random values, drawn from seed 7."""
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(t.shape, generator=g, dtype=t.dtype) * 1e-3 for n, t in c.service.inspect().weights.items()}


def merged(c: BackgroundCoordinator, client: CoordinatorClient) -> dict[str, torch.Tensor]:
    """The model once round 0 (p0's) has closed and committed."""
    client.wait_round(0, "p0", wait_s=10)
    deadline = time.monotonic() + 10
    while c.service.inspect().committed_version < 1:
        assert time.monotonic() < deadline, "round 0 never committed"
        time.sleep(0.02)
    return {n: t.clone() for n, t in c.service.inspect().weights.items()}


def reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model after round 0 with the update uploaded whole, on a clean link."""
    with BackgroundCoordinator(tmp_path / "ref", parts_config()) as c, CoordinatorClient(c.url, PTOKEN) as client:
        client.join("p0")
        body = EncodedBody(delta_of(c))
        assert body.content_length > 4 * PART
        assert client.upload(0, "p0", body, tokens=100)["accepted"] is True
        return merged(c, client)
