"""Secure aggregation in real runs: a masked round commits the token-weighted mean a plain run
commits (within fixed-point rounding); a participant that drops after masking leaves a round that
commits with the others' aggregate; fewer than t survivors refuse the round (not committed, and it
opens again with a fresh attempt); loopback runs with secure aggregation, and with distributed DP,
train (the loss falls)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import client, put, wait_round
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.runs import heldout_loss, train_all
from tests.helpers.secagg import Site, ok, run_to_upload

pytest.importorskip("cryptography")

N_MAX = 4  # a 2^16 ring with p = 16 - 1 - 2 = 13 bits: a unit of R / 8191
RANGE = 0.5
SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": N_MAX, "secagg_range": RANGE}
TOKENS = {"a": 100, "b": 100, "c": 200}


def deltas(c: BackgroundCoordinator) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return {pid: {n: (torch.rand(t.shape, generator=g) - 0.5) * 0.4 for n, t in c.service.inspect().weights.items()}
            for pid in TOKENS}


def wait_version(c: BackgroundCoordinator, v: int) -> None:
    deadline = time.monotonic() + 20
    while c.service.inspect().committed_version < v:
        assert time.monotonic() < deadline, c.service.status()["reason"]
        time.sleep(0.02)


def unit() -> float:
    return RANGE / (2**13 - 1)


def test_a_masked_round_commits_what_a_plain_run_commits(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "masked", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = deltas(c)
        sites = [Site(http, pid) for pid in TOKENS]
        run_to_upload(sites, TOKENS)
        assert c.service.status()["secure_aggregation"]["phase"] == "upload"
        assert [s.weight for s in sites] == pytest.approx([0.25, 0.25, 0.5])
        for s in sites:
            ok(s.upload(s.masked(ds[s.pid]), TOKENS[s.pid]))
        # the round closed with the last upload: the survivors reveal, then it merges
        deadline = time.monotonic() + 10
        while c.service.status()["secure_aggregation"]["phase"] != "reveal":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for s in sites:
            ok(s.reveal())
        wait_version(c, 1)
        masked = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        status = c.service.status()
        record = c.service.round_history(1)[0]
    ring_bytes = sum(2 * t.numel() for t in masked.values())  # 2 bytes a parameter in the 2^16 ring
    assert record["n_submissions"] == 3 and 3 * ring_bytes < record["bytes_in"] < 3 * (ring_bytes + 4096)
    assert status["secure_aggregation"]["round"] == 1 and status["secure_aggregation"]["phase"] == "keys"
    with BackgroundCoordinator(tmp_path / "plain", tiny_config(outer={"algorithm": "fedavg"})) as c, \
            client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        for pid, tok in TOKENS.items():
            assert put(http, 0, pid, ds[pid], tokens=tok).status_code == 200
        assert wait_round(http, 0)["state"] == "closed"
        plain = c.service.inspect().weights
    moved = 0.0
    for n, t in plain.items():
        # each contribution is off by at most half a unit: 3 of them, over a total weight of 1
        assert torch.allclose(masked[n], t, rtol=0, atol=3 * unit() / 2 + 1e-6), n
        moved = max(moved, float((t - before[n]).abs().max()))
    assert moved > 100 * unit()  # the round really moved the weights


def test_a_dropout_after_masking_leaves_the_others_exact_aggregate(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = deltas(c)
        sites = [Site(http, pid) for pid in TOKENS]
        run_to_upload(sites, TOKENS)
        a, b, gone = sites
        masked_c = gone.masked(ds["c"])  # c masks (its pairwise masks are in a's and b's uploads too)...
        assert masked_c
        for s in (a, b):
            ok(s.upload(s.masked(ds[s.pid]), TOKENS[s.pid]))
        ok(http.post("/v1/participants/c/leave"))  # ...and drops before its upload
        deadline = time.monotonic() + 10
        while c.service.status()["secure_aggregation"]["phase"] != "reveal":
            assert time.monotonic() < deadline, c.service.status()["reason"]
            time.sleep(0.02)
        for s in (a, b):
            ok(s.reveal())
        wait_version(c, 1)
        after = c.service.inspect().weights
        record = c.service.round_history(1)[0]
    assert record["n_submissions"] == 2
    for n, t in after.items():  # fedavg: θ - (¼Δa + ¼Δb) / ½
        want = before[n] - (ds["a"][n] + ds["b"][n]) / 2
        assert torch.allclose(t, want, rtol=0, atol=2 * unit() / 2 / 0.5 + 1e-6), n


def test_fewer_than_t_survivors_refuse_the_round_and_it_opens_again(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = deltas(c)
        sites = [Site(http, pid) for pid in TOKENS]
        run_to_upload(sites, TOKENS)
        old = sites[0].session
        for s in sites[:2]:
            ok(s.upload(s.masked(ds[s.pid]), TOKENS[s.pid]))
        ok(http.post("/v1/participants/c/leave"))  # 2 survivors, t = 3: the sum cannot be unmasked
        deadline = time.monotonic() + 10
        while c.service.status()["secure_aggregation"]["refused_attempts"] < 1:
            assert time.monotonic() < deadline, c.service.status()["reason"]
            time.sleep(0.02)
        status = c.service.status()
        assert status["current_round"] == 0 and not status["closing"] and status["submitted"] == []
        assert status["secure_aggregation"]["phase"] == "keys" and status["secure_aggregation"]["session"] != old
        assert "refused" in status["reason"] or "opened again" in status["reason"]
        assert c.service.inspect().committed_version == 0
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(t, before[n]), n  # not committed, not wrong: nothing moved
        events = [e["message"] for e in c.service.event_log(20) if e["kind"] == "secagg_refused"]
        assert events and "fewer than t = 3" in events[0]
        # the old attempt's participants are told to start again
        r = http.get("/v1/rounds/0/secagg/unmask/a", params={"session": old})
        assert r.status_code == 409 and r.json()["error"]["code"] == "secagg_session"


def test_a_loopback_run_with_secure_aggregation_trains(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, train={"sync_every": 10, "lr": 1e-2}, min_participants=2, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        train_all(c.url, 2)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        status = c.service.status()
        history = c.service.round_history(10)
    assert status["current_round"] == 4 and status["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in final.values())
    assert all(r["n_submissions"] == 2 and r["bytes_in"] < 2 * (2 * params + 4096) for r in history)
    assert heldout_loss(final) < initial - 1.0


def test_a_loopback_run_with_distributed_dp_trains_and_reports_epsilon(tmp_path: Path) -> None:
    pytest.importorskip("dp_accounting")
    cfg = tiny_config(rounds=4, train={"sync_every": 10, "lr": 1e-2}, min_participants=2,
                      privacy={**SECAGG, "dp": True, "clip_norm": 5.0, "noise_multiplier": 0.01})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        train_all(c.url, 2)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        p = c.service.status()["privacy"]
    assert p["rounds"] == 4 and p["epsilon"] > 0
    assert heldout_loss(final) < initial - 1.0
