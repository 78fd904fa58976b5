"""Asynchronous mode from a hostile participant: an update is trained from a version that
existed (0 <= base <= the current version), or it is refused and never applied; a refusal
costs the run nothing and the next honest update is applied as usual."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.policy import async_rules
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import ATOKEN, tiny_config

ASYNC = tiny_config(rounds=0, schedule={"mode": "async"}, asynchronous={"max_staleness": 4})


def small_delta(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}


def wait_committed(c: BackgroundCoordinator, version: int) -> None:
    deadline = time.monotonic() + 20
    while c.service.inspect().committed_version < version:
        assert time.monotonic() < deadline, f"version {version} never committed"
        time.sleep(0.02)


def test_the_policy_refuses_a_base_version_that_never_existed() -> None:
    for base in (-1, -(2**53)):
        refused = async_rules.admit(base, 1, closing=False, finished=False, cfg=ASYNC)
        assert (refused.action, refused.code) == ("refuse", "invalid_version") and "never existed" in refused.reason
    assert async_rules.admit(2, 1, closing=False, finished=False, cfg=ASYNC).code == "round_closed"  # not yet
    assert async_rules.admit(0, 1, closing=False, finished=False, cfg=ASYNC).staleness == 1


def test_an_update_from_version_minus_one_is_refused_and_not_applied(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", ASYNC) as c, client(c, ATOKEN) as http:
        for name in "ab":
            http.post("/v1/join", json={"name": name})
        delta = small_delta(c)
        assert put(http, 0, "a", delta).json()["applied_in"] == 0
        wait_committed(c, 1)
        weights = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        err = assert_error(put(http, -1, "b", delta), 422, "invalid_request")
        assert "round_" in err["message"]
        assert_error(put(http, 2, "b", delta), 409, "round_closed")  # a version that does not exist yet
        time.sleep(0.2)  # (an update applied would commit version 2 within this)
        inside = c.service.inspect()
        assert inside.committed_version == 1 and inside.submitted == {}
        assert all(torch.equal(t, weights[n]) for n, t in inside.weights.items())
        events = http.get("/v1/events").json()["events"]
        assert not [e for e in events if e.get("participant_id") == "b" and e["kind"] != "join"], events
        # the run goes on: b's honest update from version 1 is applied, fresh
        honest = put(http, 1, "b", delta).json()
        assert (honest["applied_in"], honest["staleness"]) == (1, 0)
        wait_committed(c, 2)
