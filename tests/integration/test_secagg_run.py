"""Secure aggregation in real runs: a masked round commits the token-weighted mean a plain run
commits (within fixed-point rounding); a participant that drops after masking leaves a round that
commits with the others' aggregate; fewer than t survivors refuse the round (not committed, and it
opens again with a fresh attempt); loopback runs with secure aggregation, and with distributed DP,
train (the loss falls)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant.engine.secagg_sync import submit_masked
from fedtrain.participant.engine.sync import SyncEngine
from tests.helpers.api import client
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.secagg import Site, ok
from tests.helpers.secagg_rounds import (
    SECAGG,
    TOKENS,
    Deltas,
    EngineSites,
    join_all,
    plain_round,
    random_deltas,
    reveal_and_commit,
    sites_at_upload,
    train_loopback,
    unit,
    upload_masked,
    wait_version,
    weights_now,
)

pytest.importorskip("cryptography")


def deltas(c: BackgroundCoordinator) -> Deltas:
    return random_deltas(c.service.inspect().weights, seed=7)


def ready_to_upload(c: BackgroundCoordinator, http: httpx.Client) -> tuple[dict[str, torch.Tensor], Deltas, list[Site]]:
    """Every site joined, through the keys and shares phases: the weights before, each site's Δ, the sites."""
    join_all(http)
    before, ds = weights_now(c), deltas(c)
    return before, ds, sites_at_upload(http)


def test_a_masked_round_commits_what_a_plain_run_commits(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "masked", cfg) as c, client(c, ATOKEN) as http:
        before, ds, sites = ready_to_upload(c, http)
        assert c.service.status()["secure_aggregation"]["phase"] == "upload"
        assert [s.weight for s in sites] == pytest.approx([0.25, 0.25, 0.5])
        upload_masked(sites, ds)
        reveal_and_commit(c, sites)  # the round closed with the last upload: the survivors reveal, then it merges
        masked = weights_now(c)
        status = c.service.status()
        record = c.service.round_history(1)[0]
    ring_bytes = sum(2 * t.numel() for t in masked.values())  # 2 bytes a parameter in the 2^16 ring
    assert record["n_submissions"] == 3 and 3 * ring_bytes < record["bytes_in"] < 3 * (ring_bytes + 4096)
    assert status["secure_aggregation"]["round"] == 1 and status["secure_aggregation"]["phase"] == "keys"
    plain = plain_round(tmp_path / "plain", tiny_config(outer={"algorithm": "fedavg"}), ds)
    moved = 0.0
    for n, t in plain.items():
        # each contribution is off by at most half a unit: 3 of them, over a total weight of 1
        assert torch.allclose(masked[n], t, rtol=0, atol=3 * unit() / 2 + 1e-6), n
        moved = max(moved, float((t - before[n]).abs().max()))
    assert moved > 100 * unit()  # the round really moved the weights


def test_a_dropout_after_masking_leaves_the_others_exact_aggregate(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        before, ds, (a, b, gone) = ready_to_upload(c, http)
        masked_c = gone.masked(ds["c"])  # c masks (its pairwise masks are in a's and b's uploads too)...
        assert masked_c
        upload_masked([a, b], ds)
        ok(http.post("/v1/participants/c/leave"))  # ...and drops before its upload
        reveal_and_commit(c, [a, b])
        after = c.service.inspect().weights
        record = c.service.round_history(1)[0]
    assert record["n_submissions"] == 2
    for n, t in after.items():  # fedavg: θ - (¼Δa + ¼Δb) / ½
        want = before[n] - (ds["a"][n] + ds["b"][n]) / 2
        assert torch.allclose(t, want, rtol=0, atol=2 * unit() / 2 / 0.5 + 1e-6), n


def test_fewer_than_t_survivors_refuse_the_round_and_it_opens_again(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        before, ds, sites = ready_to_upload(c, http)
        old = sites[0].session
        upload_masked(sites[:2], ds)
        ok(http.post("/v1/participants/c/leave"))  # 2 survivors, t = 3: the sum cannot be unmasked
        deadline = time.monotonic() + 10
        while c.service.status()["secure_aggregation"]["refused_attempts"] < 1:
            assert time.monotonic() < deadline, c.service.status()["reason"]
            time.sleep(0.02)
        status = c.service.status()
        assert status["current_round"] == 0 and not status["closing"] and status["submitted"] == []
        assert status["secure_aggregation"]["phase"] == "keys" and status["secure_aggregation"]["session"] != old
        # (status["reason"] says "opened again" only until the next tick re-decides the round: the
        # event log and refused_attempts are what keep it)
        assert c.service.inspect().committed_version == 0
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(t, before[n]), n  # not committed, not wrong: nothing moved
        assert c.service.submissions(0) == []  # the refused attempt's uploads are not the round's
        events = [e["message"] for e in c.service.event_log(20) if e["kind"] == "secagg_refused"]
        assert events and "fewer than t = 3" in events[0] and "opens again" in events[0]
        # the old attempt's participants are told to start again
        r = http.get("/v1/rounds/0/secagg/unmask/a", params={"session": old})
        assert r.status_code == 409 and r.json()["error"]["code"] == "secagg_session"


def test_a_loopback_run_with_secure_aggregation_trains(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, train={"sync_every": 10, "lr": 1e-2}, min_participants=2, privacy=SECAGG)
    run = train_loopback(tmp_path / "state", cfg)
    assert run.status["current_round"] == 4 and run.status["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in run.final.values())
    assert all(r["n_submissions"] == 2 and r["bytes_in"] < 2 * (2 * params + 4096) for r in run.history)
    assert run.final_loss < run.initial_loss - 1.0


def test_a_loopback_run_with_distributed_dp_trains_and_reports_epsilon(tmp_path: Path) -> None:
    pytest.importorskip("dp_accounting")
    cfg = tiny_config(rounds=4, train={"sync_every": 10, "lr": 1e-2}, min_participants=2,
                      privacy={**SECAGG, "dp": True, "clip_norm": 5.0, "noise_multiplier": 0.01})
    run = train_loopback(tmp_path / "state", cfg)
    p = run.status["privacy"]
    assert p["rounds"] == 4 and p["epsilon"] > 0
    assert run.final_loss < run.initial_loss - 1.0


def test_a_restarted_coordinator_runs_the_round_again_with_fresh_keys(tmp_path: Path) -> None:
    """A coordinator never loads a partial round: after a restart mid-round the round's secure
    aggregation starts again with a new session, the old session's requests are refused with
    409 secagg_session (the participant's cue to start the round's steps again), and the round
    then commits."""
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        before, ds, sites = ready_to_upload(c, http)
        ok(sites[0].upload(sites[0].masked(ds["a"]), TOKENS["a"]))  # one masked upload in, then the restart
        old, port = sites[0].session, c.port
    with BackgroundCoordinator(tmp_path / "s", cfg, port=port) as c, client(c, ATOKEN) as http:
        stale = http.get("/v1/rounds/0/secagg/mailbox/b", params={"session": old})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "secagg_session"
        sites = sites_at_upload(http)
        assert sites[0].session != old
        upload_masked(sites, ds)
        reveal_and_commit(c, sites)
        after = c.service.inspect().weights
    for n, t in after.items():
        want = before[n] - (ds["a"][n] + ds["b"][n] + 2 * ds["c"][n]) / 4
        assert torch.allclose(t, want, rtol=0, atol=3 * unit() / 2 + 1e-6), n


def test_distributed_dp_noise_comes_from_the_participants_at_the_promised_scale(tmp_path: Path) -> None:
    """Three real participant engines send a zero Δ: what the round moves the weights by is the
    participants' noise alone (the coordinator adds none), with the variance the participants
    promise: each adds (σ·w_max·C)² / t, three of them over a total weight of 1."""
    pytest.importorskip("dp_accounting")
    sigma, clip = 1.0, 0.01
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={
        **SECAGG, "dp": True, "clip_norm": clip, "noise_multiplier": sigma, "secagg_range": 0.05})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        before = weights_now(c)

        def zero_delta(pid: str, engine: SyncEngine, params: dict[str, torch.Tensor]) -> None:
            engine.take_delta()  # θ_round − θ = 0
            assert submit_masked(engine, 0, pid, cfg, tokens=TOKENS[pid])

        sites = EngineSites(c, before, zero_delta)
        sites.start()
        sites.join()
        wait_version(c, 1)
        moved = torch.cat([(c.service.inspect().weights[n] - before[n]).flatten() for n in before]).double()
        p = c.service.status()["privacy"]
        t_ = c.service.round_history(1)[0]
    assert t_["n_submissions"] == 3 and p["rounds"] == 1 and p["epsilon"] > 0 and p["mechanism"] == "distributed"
    w_max, n_min = 0.5, 2  # shares 1/4, 1/4, 1/2; t = max(2, ceil(2·3/3)) = 2
    want = sigma * w_max * clip * math.sqrt(3 / n_min)
    assert float(moved.std()) == pytest.approx(want, rel=0.05)  # ~10^4 values: the sample std is within 1%
    assert abs(float(moved.mean())) < 5 * want / math.sqrt(moved.numel())


@pytest.mark.slow
def test_a_real_participant_that_drops_after_masking_leaves_a_round_that_commits(tmp_path: Path) -> None:
    """Through the participant's own code: p2 masks but never sends its upload in round 1 (it stays
    active, so the round waits for its deadline); the round commits with p0's and p1's aggregate,
    and p2 carries on from the new model."""
    cfg = tiny_config(rounds=3, train={"sync_every": 10, "lr": 1e-2}, min_participants=2, round_timeout_s=8,
                      privacy={**SECAGG, "secagg_threshold": 2})
    rule = faults.arm(faults.Rule("participant.upload", "drop", who="p2", round=1))
    try:
        run = train_loopback(tmp_path / "state", cfg, n=3)
    finally:
        faults.disarm()
    history, status = {r["round"]: r for r in run.history}, run.status
    assert rule.fired == 1
    assert status["current_round"] == 3 and status["secure_aggregation"]["refused_attempts"] == 0
    assert history[0]["n_submissions"] == 3 and history[1]["n_submissions"] == 2
    assert {s["participant_id"] for s in history[1]["submissions"]} == {"p0", "p1"}
