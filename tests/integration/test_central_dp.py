"""Central differential privacy in real runs: the noise on a round's mean has the scale σ·w_max·C
(w_max the largest capped share) and is not drawn from the run's seed; the (ε, δ) in the status
and in every checkpoint's metadata is dp-accounting's own figure for the rounds merged, and it
survives a restart; a loopback run with DP trains (the loss falls)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from fedtrain import faults
from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import client, put, wait_round
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.runs import heldout_loss, train_all

dpa = pytest.importorskip("dp_accounting")

META = "fedtrain.privacy"


def library_epsilon(sigma: float, rounds: int, delta: float, kind: str) -> float:
    """dp-accounting composing `rounds` Gaussian mechanisms itself."""
    acc = dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()
    acc.compose(dpa.GaussianDpEvent(sigma), rounds)
    return float(acc.get_epsilon(delta))


def zero_round(c: BackgroundCoordinator, r: int, tokens: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each participant sends a zero update for round r (the mean is exactly 0; the admin's client
    acts for anyone, across restarts); returns what the round moved the weights by: the noise
    alone (fedavg, lr 1)."""
    before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    with client(c, ATOKEN) as http:
        for pid, tok in tokens.items():
            assert put(http, r, pid, {n: torch.zeros_like(t) for n, t in before.items()}, tokens=tok).status_code == 200
        assert wait_round(http, r)["state"] == "closed"
    after = c.service.inspect().weights
    return {n: after[n] - before[n] for n in before}


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_has_the_scale_of_the_largest_share_and_epsilon_is_the_librarys(tmp_path: Path,
                                                                              accountant: str) -> None:
    sigma, clip, delta = 2.0, 0.1, 1e-6
    cfg = tiny_config(outer={"algorithm": "fedavg"}, min_participants=3,
                      privacy={"clip_norm": clip, "noise_multiplier": sigma, "delta": delta, "accountant": accountant})
    tokens = {"a": 100, "b": 100, "c": 200}  # shares 1/4, 1/4, 1/2: w_max = 1/2
    noises = []
    for run in ("one", "two"):  # two runs of the same config and seed
        with BackgroundCoordinator(tmp_path / run, cfg) as c:
            with client(c, ATOKEN) as http:
                for pid in tokens:
                    http.post("/v1/join", json={"name": pid})
            noise = torch.cat([t.flatten() for t in zero_round(c, 0, tokens).values()]).double()
            status = c.service.status()
        noises.append(noise)
        n, want = noise.numel(), sigma * 0.5 * clip
        assert n > 10_000
        # the sample std of n normals is within ~1/sqrt(2n) (< 1%) of the true one: 5% never flakes
        assert float(noise.std()) == pytest.approx(want, rel=0.05)
        assert abs(float(noise.mean())) < 5 * want / math.sqrt(n)
        p = status["privacy"]
        assert p["rounds"] == 1 and p["delta"] == delta
        assert p["epsilon"] == pytest.approx(library_epsilon(sigma, 1, delta, accountant), rel=1e-3)
    # the noise is drawn from the OS CSPRNG, not the run's seed: the two runs' noises differ
    assert not torch.allclose(noises[0], noises[1])


def test_epsilon_after_every_round_in_status_and_checkpoints_and_after_a_restart(tmp_path: Path) -> None:
    sigma, delta = 1.5, 1e-5
    cfg = tiny_config(rounds=4, outer={"algorithm": "fedavg"},
                      privacy={"clip_norm": 1.0, "noise_multiplier": sigma, "delta": delta, "epsilon_budget": 50})
    state = tmp_path / "state"
    seen = []
    with BackgroundCoordinator(state, cfg) as c:
        with client(c, ATOKEN) as http:
            http.post("/v1/join", json={"name": "a"})
        assert c.service.status()["privacy"]["rounds"] == 0 and c.service.status()["privacy"]["epsilon"] == 0.0
        for r in range(3):
            zero_round(c, r, {"a": 100})
            p = c.service.status()["privacy"]
            assert p["rounds"] == r + 1 and p["budget"] == 50 and not p["over_budget"]
            assert p["epsilon"] == pytest.approx(library_epsilon(sigma, r + 1, delta, "rdp"), rel=1e-6)
            seen.append(p["epsilon"])
        rounds_events = [e["message"] for e in c.service.event_log(50) if e["kind"] == "round"]
        assert any(f"(ε, δ) = ({seen[-1]:.4g}, 1e-05)" in m for m in rounds_events), rounds_events
        ckpt = c.service.inspect().checkpoints
        for v in (1, 2, 3):  # keep_checkpoints 3: versions 1-3 are kept
            record = json.loads(ckpt.run_metadata(v)[META])
            assert record["rounds"] == v and record["epsilon"] == pytest.approx(seen[v - 1])
    assert seen == sorted(seen) and seen[0] > 0
    with BackgroundCoordinator(state, cfg) as c:  # a restart: the count comes from the committed version
        with client(c, ATOKEN) as http:
            p = http.get("/v1/status").json()["privacy"]
            assert p["rounds"] == 3 and p["epsilon"] == pytest.approx(seen[-1])
            assert f"(ε, δ) = ({seen[-1]:.4g}, 1e-05) after 3 rounds" in format_status(http.get("/v1/status").json())
        zero_round(c, 3, {"a": 100})
        assert c.service.status()["privacy"]["epsilon"] == pytest.approx(
            library_epsilon(sigma, 4, delta, "rdp"), rel=1e-6)


def test_a_roll_back_keeps_the_count_of_noisy_rounds(tmp_path: Path) -> None:
    """Rolling back to a kept version does not take back what was released: the restored version
    records the rounds merged with noise so far, and a restart reads them from it."""
    cfg = tiny_config(rounds=5, outer={"algorithm": "fedavg"}, privacy={"noise_multiplier": 2.0})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        with client(c, ATOKEN) as http:
            http.post("/v1/join", json={"name": "a"})
        for r in range(2):
            zero_round(c, r, {"a": 100})
        with client(c, ATOKEN) as http:
            assert http.post("/v1/admin/rollback", json={"version": 1}).json()["version"] == 3
        assert c.service.status()["privacy"]["rounds"] == 2
        assert json.loads(c.service.inspect().checkpoints.run_metadata(3)[META])["rounds"] == 2
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        assert c.service.status()["privacy"]["rounds"] == 2


def test_merges_rolled_back_count_and_the_run_stops_at_the_budget(tmp_path: Path) -> None:
    """The budget fits the 3 planned rounds; a failed commit makes round 1 merge twice (its first
    model may have been served: publish_first), so after 3 noisy merges at version 2 a fourth would
    pass the budget: the run finishes there, and says why."""
    sigma, delta = 2.0, 1e-5
    budget = library_epsilon(sigma, 3, delta, "rdp") * 1.001
    cfg = tiny_config(rounds=3, outer={"algorithm": "fedavg"}, publish_first=True,
                      privacy={"noise_multiplier": sigma, "delta": delta, "epsilon_budget": budget})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        with client(c, ATOKEN) as http:
            http.post("/v1/join", json={"name": "a"})
        zero_round(c, 0, {"a": 100})
        rule = faults.arm(faults.Rule("commit.before_db", "raise", round=1))
        try:
            with client(c, ATOKEN) as http:
                zeros = {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}
                assert put(http, 1, "a", zeros).status_code == 200
                deadline = time.monotonic() + 20
                while not (rule.fired == 1 and c.service.version == 1 and not c.service.status()["closing"]):
                    assert time.monotonic() < deadline, "no roll back"
                    time.sleep(0.05)
        finally:
            faults.disarm()
        assert c.service.status()["privacy"]["rounds"] == 2  # the rolled-back merge counts
        zero_round(c, 1, {"a": 100})
        status = c.service.status()
        assert status["privacy"]["rounds"] == 3 and status["privacy"]["budget_spent"]
        assert status["finished"] and status["current_round"] == 2 and not status["privacy"]["over_budget"]
        finished = [e["message"] for e in c.service.event_log(50) if e["kind"] == "finished"]
        assert finished and "ε budget" in finished[0]


def test_a_loopback_run_with_dp_trains(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=5, train={"sync_every": 10, "lr": 1e-2}, min_participants=2,
                      privacy={"clip_norm": 5.0, "noise_multiplier": 0.01})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        train_all(c.url, 2)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        p = c.service.status()["privacy"]
    assert p["rounds"] == 5 and p["epsilon"] > 0
    assert heldout_loss(final) < initial - 1.0


def test_streaming_noise_lands_on_the_rounds_fragment_only(tmp_path: Path) -> None:
    sigma, clip = 1.0, 0.2
    cfg = tiny_config(train={"sync_every": 4}, streaming={"fragments": 2}, outer={"algorithm": "fedavg"},
                      model={"n_layer": 2},
                      privacy={"clip_norm": clip, "noise_multiplier": sigma})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        frags = http.post("/v1/join", json={"name": "a"}).json()["streaming"]["fragments"]
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        zeros = {n: torch.zeros_like(before[n]) for n in frags[0]}
        assert put(http, 0, "a", zeros).status_code == 200
        assert wait_round(http, 0)["state"] == "closed"
        after = c.service.inspect().weights
        for n in frags[1]:  # the other fragment: not a bit of noise
            assert torch.equal(after[n], before[n]), n
        noise = torch.cat([(after[n] - before[n]).flatten() for n in frags[0]]).double()
        assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.05)  # one participant: w_max 1
        assert c.service.status()["privacy"]["rounds"] == 1  # each fragment sync is a round of the accounting
