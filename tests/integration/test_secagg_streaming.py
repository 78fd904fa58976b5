"""Secure aggregation with Streaming DiLoCo and the overlapped sync: a round masks and sums its
fragment's tensors only, and commits what a plain streaming round commits (within fixed-point
rounding) on that fragment, leaving the other fragment as it was; loopback runs that stream
fragments (τ > 0: sent while training goes on) and that overlap their sync, with secure
aggregation, train (the loss falls); masks drawn during the inner steps (keys and shares before
the token claim) give the plain mean."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant.engine.secagg_sync import start_ahead, submit_masked
from fedtrain.participant.engine.sync import SyncEngine
from tests.helpers.api import client
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.secagg_rounds import (
    SECAGG,
    TOKENS,
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

STREAMING = {"train": {"sync_every": 4}, "model": {"n_layer": 2}, "streaming": {"fragments": 2},
             "outer": {"algorithm": "fedavg"}}


def test_a_masked_fragment_round_commits_what_a_plain_streaming_round_commits(tmp_path: Path) -> None:
    cfg = tiny_config(**STREAMING, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "masked", cfg) as c, client(c, ATOKEN) as http:
        frags = join_all(http)[0]["streaming"]["fragments"]
        before = weights_now(c)
        ds = random_deltas(before, seed=11, names=frags[0])  # round 0 syncs fragment 0
        sites = sites_at_upload(http)
        upload_masked(sites, ds)
        reveal_and_commit(c, sites)
        masked = weights_now(c)
        record = c.service.round_history(1)[0]
    ring_bytes = sum(2 * before[n].numel() for n in frags[0])  # 2 bytes a parameter of the fragment
    assert record["fragment"] == 0 and record["n_submissions"] == 3
    assert 3 * ring_bytes < record["bytes_in"] < 3 * (ring_bytes + 4096)
    plain = plain_round(tmp_path / "plain", tiny_config(**STREAMING), ds)
    moved = 0.0
    for n in frags[0]:  # each contribution is off by at most half a unit: 3 of them, over a total weight of 1
        assert torch.allclose(masked[n], plain[n], rtol=0, atol=3 * unit() / 2 + 1e-6), n
        moved = max(moved, float((plain[n] - before[n]).abs().max()))
    assert moved > 100 * unit()  # the round really moved the fragment
    for n in frags[1]:  # the other fragment is not in the round: not a bit moved
        assert torch.equal(masked[n], before[n]) and torch.equal(plain[n], before[n]), n


def test_a_streaming_run_with_secure_aggregation_trains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Fragments sent τ = 1 step before the round's end, on the worker thread (the masking steps
    and their waits too), while training goes on; each fragment's masks drawn during its inner steps."""
    cfg = tiny_config(rounds=6, min_participants=2, model={"n_layer": 2}, train={"sync_every": 10, "lr": 1e-2},
                      streaming={"fragments": 2, "overlap": 1, "alpha": 0.5}, privacy=SECAGG)
    with caplog.at_level(logging.INFO, logger="fedtrain.participant"):
        run = train_loopback(tmp_path / "state", cfg)
    history = sorted(run.history, key=lambda r: r["round"])
    assert run.status["current_round"] == 6 and run.status["secure_aggregation"]["refused_attempts"] == 0
    assert [r["fragment"] for r in history] == [0, 1, 0, 1, 0, 1]
    assert all(r["n_submissions"] == 2 for r in history)
    assert run.final_loss < run.initial_loss - 0.5
    said = [r.getMessage() for r in caplog.records]
    assert sum("drawn during the inner steps" in m for m in said) == 6 * 2, said  # every round, both


def test_an_overlapped_run_with_secure_aggregation_trains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """train.overlap: the participant sends at step H and trains on while the round's secure
    aggregation (claim, masked upload, reveal) runs on its worker thread; keys, shares and masks
    were drawn during the inner steps, every round (no participant fell back to drawing them late)."""
    cfg = tiny_config(rounds=4, min_participants=2, train={"sync_every": 10, "lr": 1e-2, "overlap": True},
                      privacy=SECAGG)
    with caplog.at_level(logging.INFO, logger="fedtrain.participant"):
        run = train_loopback(tmp_path / "state", cfg)
    assert run.status["current_round"] == 4 and run.status["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in run.final.values())
    assert all(r["n_submissions"] == 2 and r["bytes_in"] < 2 * (2 * params + 4096) for r in run.history)
    assert run.final_loss < run.initial_loss - 1.0
    said = [r.getMessage() for r in caplog.records]
    assert sum("drawn during the inner steps" in m for m in said) == 4 * 2, said  # every round, both
    assert not [m for m in said if "not drawn ahead" in m or "starts again" in m]


def test_masks_drawn_during_the_inner_steps_give_the_plain_mean(tmp_path: Path) -> None:
    """Three real participant engines join round 0's attempt at its start (`start_ahead`): keys and
    shares go out without a token claim and the masks are drawn while "training" (the coordinator
    sits in its claims phase, no claim made); after training each claims, masks and uploads with
    what was drawn, and the round commits the plain token-weighted mean within fixed-point rounding."""
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        before = weights_now(c)
        ds = random_deltas(before, seed=5)
        drawn = threading.Barrier(4, timeout=30)
        looked = threading.Event()

        def draw_ahead(pid: str, engine: SyncEngine, params: dict[str, torch.Tensor]) -> None:
            start_ahead(engine, 0, pid, cfg)  # the round's start
            assert engine.masks_ahead is not None and engine.masks_ahead.result(30) is not None
            drawn.wait()
            assert looked.wait(30)
            for n, p in params.items():  # "training": θ_round − θ = Δ
                p.sub_(ds[pid][n])
            engine.take_delta()
            assert submit_masked(engine, 0, pid, cfg, tokens=TOKENS[pid])

        sites = EngineSites(c, before, draw_ahead, on_error=drawn.abort)
        sites.start()
        drawn.wait()
        st = c.service.status()["secure_aggregation"]
        looked.set()
        sites.join()
        assert st["phase"] == "claims" and st["sharing"] == 3  # masks drawn before anyone claimed
        wait_version(c, 1)
        after = c.service.inspect().weights
    for n, t in after.items():
        want = before[n] - (ds["a"][n] + ds["b"][n] + 2 * ds["c"][n]) / 4
        assert torch.allclose(t, want, rtol=0, atol=3 * unit() / 2 + 1e-6), n
