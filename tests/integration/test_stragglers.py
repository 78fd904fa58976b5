"""Stragglers and silent participants on a real coordinator: late uploads folded with a
staleness discount, adaptive deadlines, heartbeat failure, recovery and rejoin."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from tests.helpers.api import assert_error, client, put, rand_like, wait_round
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, join_all


def test_late_upload_is_folded_into_the_next_round_with_a_discount(tmp_path: Path) -> None:
    cfg = tiny_config(
        rounds=5, outer={"algorithm": "fedavg"}, late_uploads="fold", staleness_discount=0.5, round_timeout_s=1.0
    )
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        da0, db0, da1, db1 = (rand_like(c, i) for i in range(4))
        assert put(http, 0, "a", da0).status_code == 200
        info = wait_round(http, 0)  # b straggles: round 0 closes at its 1 s deadline with a alone
        assert "deadline" in c.service.round_history()[0]["close_reason"]
        theta1 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        late = put(http, 0, "b", db0).json()
        assert late == {"accepted": True, "duplicate": False, "round": 0, "folded_into": 1, "staleness": 1}
        assert put(http, 0, "b", db0).json()["duplicate"] is True  # a resend is not folded twice
        assert put(http, 0, "a", da0).json()["duplicate"] is True  # a was part of round 0 already
        assert c.service.inspect().submitted == {}  # a late fold does not count as a submission of round 1
        assert put(http, 1, "a", da1).status_code == 200
        assert put(http, 1, "b", db1).status_code == 200
        info = wait_round(http, 1)
        assert info["current_round"] == 2
        for n, t in c.service.inspect().weights.items():  # FedAvg: θ2 = θ1 − Σ wΔ / Σ w, late weight 100 × 0.5
            want = theta1[n] - (100 * da1[n] + 100 * db1[n] + 50 * db0[n]) / 250
            torch.testing.assert_close(t, want)
        events = c.service.event_log(50)
        assert any(e["kind"] == "late" and "folded into round 1" in e["message"] for e in events)
        # two rounds late is more than max_staleness (1): refused like any closed round
        assert_error(put(http, 0, "b", db0), 409, "round_closed")


def test_adaptive_deadline_closes_a_stalled_round_early(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=5, deadline="adaptive", deadline_factor=2.0, deadline_min_s=0.5, round_timeout_s=120.0)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        assert http.get("/v1/status").json()["deadline_s"] == 120.0  # nothing observed yet
        put(http, 0, "a", rand_like(c, 0))
        put(http, 0, "b", rand_like(c, 1))
        wait_round(http, 0)
        status = http.get("/v1/status").json()
        # The rule, not the stopwatch: 2 x the median submit time observed, at least deadline_min_s,
        # well under the fixed 120 s (how long the submits took depends on the machine's load).
        deadline_s = status["deadline_s"]
        assert 0.5 <= deadline_s < 120.0 and "adaptive deadline" in status["deadline_reason"]
        typical = float(re.search(r"median submit time ([0-9.]+)s", status["deadline_reason"])[1])
        assert deadline_s == pytest.approx(max(0.5, 2.0 * typical), abs=0.1)  # the reason rounds to 0.1 s
        put(http, 1, "a", rand_like(c, 2))  # b stalls; the fixed deadline would wait 120 s
        wait_round(http, 1, timeout=60)
        reason = c.service.round_history()[0]["close_reason"]
        assert f"deadline of {deadline_s:g}s passed" in reason and "b" in reason


def test_silent_participant_fails_then_recovers_on_heartbeat(tmp_path: Path) -> None:
    cfg = tiny_config(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "quiet"})
        deadline = time.monotonic() + 15
        while c.service.inspect().participants["quiet"].state != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = http.post("/v1/participants/quiet/heartbeat", json={"step": 3}).json()
        assert r["state"] == "active"
        kinds = [e["kind"] for e in c.service.event_log(20)]
        assert "fail" in kinds and "recover" in kinds


def _straggler(url: str, name: str) -> TinyParticipant:
    """`Small` fitting a fixed batch, seeded by its name; an injected crash ends it quietly."""
    return TinyParticipant(url, name, Regression(rows=16, seed=hash(name) % 1000), step_sleep_s=0.01, crashes=True)


def test_participant_fails_at_round_and_rejoins_with_current_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(
        rounds=6,
        min_participants=2,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=1.5,
        train={"sync_every": 3},
        outer={"algorithm": "fedavg"},
    )
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with faults.inject("participant.sync", "crash", who="p2", round=1) as rule:
            runners = [_straggler(c.url, f"p{i}").start() for i in range(3)]
            deadline = time.monotonic() + 60
            while c.service.version < 3:  # p0 and p1 carry on without p2
                assert time.monotonic() < deadline and not any(r.error for r in runners), [r.error for r in runners]
                time.sleep(0.05)
        runners[2].join(timeout=60)
        assert rule.fired == 1 and runners[2].crashed
        assert c.service.inspect().participants["p2"].state == "failed"
        rounds = {r["round"]: r for r in c.service.round_history()}
        assert rounds[1]["n_submissions"] == 2  # round 1 closed without the failed participant
        back = _straggler(c.url, "p2").start()
        assert back.joined.wait(30), back.error
        joined_at = back.joined_at
        assert joined_at is not None and joined_at >= 3
        with CoordinatorClient(c.url, ATOKEN) as admin:  # it starts from the current global weights
            _, global_then = admin.download(version=joined_at)
        assert set(global_then) == {"lin.weight", "lin.bias", "head.weight", "head.bias"}
        for n, t in global_then.items():
            assert torch.equal(back.initial[n], t), n
        join_all(*runners[:2], back, timeout=60)
        assert c.service.finished
        final = c.service.inspect().weights
        for n in final:
            for r in (*runners[:2], back):  # everyone ends on the global weights
                assert torch.equal(r.weights[n], final[n]), (r.name, n)
        events = [(e["kind"], e["message"]) for e in c.service.event_log(200)]
        assert any(k == "fail" and "p2" in m for k, m in events)
        assert any(k == "join" and "p2 rejoined" in m and "failed" in m for k, m in events)
        last = max(rounds) + 1
        assert any(
            s["participant_id"] == "p2"
            for r in c.service.round_history()
            if r["round"] >= last
            for s in r["submissions"]
        )
