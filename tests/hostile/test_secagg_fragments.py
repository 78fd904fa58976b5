"""Secure aggregation with Streaming DiLoCo against hostile clients: a round's ring sum holds its
fragment's tensors only, so a masked body naming the whole model, the other fragment, or the
fragment's tensors with the wrong number of ring values is refused (400) before it touches the
sum, and the round then commits from the honest uploads alone; the masking route answers the
next round with the next fragment's attempt (a fresh session: a body of the old one is refused)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.privacy.round_setup import SECAGG_META
from tests.helpers.api import assert_error, client
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.secagg import Site, ok, run_to_upload

pytest.importorskip("cryptography")

SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": 4, "secagg_range": 0.5,
          "secagg_threshold": 2}
TOKENS = {"a": 100, "b": 100}


@pytest.fixture
def run(tmp_path: Path) -> Any:
    cfg = tiny_config(train={"sync_every": 4}, model={"n_layer": 2}, streaming={"fragments": 2},
                      outer={"algorithm": "fedavg"}, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        frags = [ok(http.post("/v1/join", json={"name": pid}))["streaming"]["fragments"] for pid in TOKENS][-1]
        yield c, http, frags


def ring_zeros(c: BackgroundCoordinator, names: list[str]) -> dict[str, torch.Tensor]:
    w = c.service.inspect().weights
    return {n: torch.zeros(w[n].numel(), dtype=torch.uint16) for n in names}


def test_a_masked_body_outside_the_rounds_fragment_is_refused_before_the_ring_sum(run: Any) -> None:
    c, http, frags = run
    sites = [Site(http, pid) for pid in TOKENS]
    run_to_upload(sites, TOKENS)
    a = sites[0]
    meta = {SECAGG_META: json.dumps({"session": a.session, "bits": 16})}
    whole = ring_zeros(c, frags[0] + frags[1])
    assert_error(a.upload(whole, TOKENS["a"], meta=meta), 400)  # the whole model: round 0 syncs fragment 0
    assert_error(a.upload(ring_zeros(c, frags[1]), TOKENS["a"], meta=meta), 400)  # the other fragment
    name = frags[0][0]
    short = {**ring_zeros(c, frags[0]), name: torch.zeros(1, dtype=torch.uint16)}
    assert_error(a.upload(short, TOKENS["a"], meta=meta), 400)  # the fragment's names, the wrong length
    assert c.service.status()["submitted"] == []  # none of them counted
    w = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    for s in sites:  # the honest uploads (the fragment's tensors): the round commits from them alone
        ok(s.upload(s.masked({n: torch.full_like(w[n], 0.01) for n in frags[0]}), TOKENS[s.pid]))
    deadline = time.monotonic() + 10
    while c.service.status()["secure_aggregation"]["phase"] != "reveal":
        assert time.monotonic() < deadline, c.service.status()["reason"]
        time.sleep(0.02)
    for s in sites:
        ok(s.reveal())
    while c.service.inspect().committed_version < 1:
        assert time.monotonic() < deadline + 10, c.service.status()["reason"]
        time.sleep(0.02)
    after = c.service.inspect().weights
    for n in frags[0]:  # fedavg: θ − 0.01 within fixed-point rounding
        assert torch.allclose(after[n], w[n] - 0.01, rtol=0, atol=1e-4), n
    for n in frags[1]:
        assert torch.equal(after[n], w[n]), n
    # round 1 syncs fragment 1 in a fresh attempt: a body of round 0's session is refused
    st = ok(http.get("/v1/rounds/1/secagg", params={"participant_id": "a"}))
    assert st["session"] != a.session and st["phase"] == "keys"
    assert_error(a.upload(ring_zeros(c, frags[1]), TOKENS["a"], meta=meta), 409)
