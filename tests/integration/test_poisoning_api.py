"""One hostile participant against the real coordinator: finite values that would make the
committed model non-finite, and token claims that would take the whole merge.

The hostile update is refused (or its weight bounded and capped), an event names its
participant, the round closes with the others and the run goes on with a finite model.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from fedtrain.config import outer_defaults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.merge import OuterOptimizer
from fedtrain.wire import iter_file, read_tensors
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import tiny_config

BIG = 3e38  # finite float32: passes the NaN/Inf checks
BOUND = 5 * 8 * 32 * 16  # tiny_config's schedule (H 5, batch 8, seq_len 32) x token_slack 16


def deltas(c: BackgroundCoordinator, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in c.service.inspect().weights.items()}


def filled(c: BackgroundCoordinator, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, value) for n, t in c.service.inspect().weights.items()}


def wait_closed(http: httpx.Client, r: int) -> dict:
    info = http.get(f"/v1/rounds/{r}", params={"wait": 20}).json()
    assert info["state"] == "closed", info
    return info


def events(http: httpx.Client, kind: str) -> list[dict]:
    return [e for e in http.get("/v1/events").json()["events"] if e["kind"] == kind]


def last_weights(http: httpx.Client) -> dict[str, float]:
    rnd = http.get("/v1/status").json()["recent_rounds"][0]
    return {s["participant_id"]: s["weight"] for s in rnd["submissions"]}


def assert_model_finite(c: BackgroundCoordinator, http: httpx.Client, version: int) -> None:
    served = load_safetensors(http.get("/v1/model", params={"version": version}).content)
    on_disk = dict(read_tensors(iter_file(c.service.inspect().checkpoints.global_path(version))))
    for tensors in (served, on_disk):
        assert set(tensors) == set(c.service.inspect().weights)
        assert all(torch.isfinite(t).all() for t in tensors.values())


def test_diloco_a_huge_finite_update_with_a_huge_claim_is_refused_and_the_run_goes_on(tmp_path: Path) -> None:
    """3e38 everywhere with tokens=2**62: finite, so it passed the NaN/Inf checks, and Nesterov
    made the committed model -Inf. Now: 422 before it is merged, an event, a finite model."""
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=3)) as c, client(c) as http:
        for pid in "abc":
            http.post("/v1/join", json={"name": pid})
        err = assert_error(put(http, 0, "c", filled(c, BIG), tokens=2**62), 422, "out_of_range")
        assert "magnitude 3e+38" in err["message"] and "1.15e+18" in err["message"]
        refused = events(http, "refuse")
        assert [e["participant_id"] for e in refused] == ["c"] and "out_of_range" not in refused[0]["message"]
        assert c.service.inspect().sum_count == 0 and http.get("/v1/rounds/0").json()["n_submitted"] == 0
        for r in range(3):  # c sends a sane update after all; every round closes with the three
            for i, pid in enumerate("abc"):
                assert put(http, r, pid, deltas(c, 10 * r + i)).status_code == 200
            wait_closed(http, r)
            assert_model_finite(c, http, r + 1)
        assert http.get("/v1/status").json()["finished"]


def test_fedavg_two_huge_uploads_are_refused_and_the_round_closes_with_the_others(tmp_path: Path) -> None:
    """Two uploads of 3e38: their float32 sum was Inf, the round rolled back, every round."""
    cfg = tiny_config(outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abc":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        for pid in "ab":
            assert_error(put(http, 0, pid, filled(c, BIG)), 422, "out_of_range")
        assert {e["participant_id"] for e in events(http, "refuse")} == {"a", "b"}
        sane = {pid: deltas(c, i) for i, pid in enumerate("abc")}
        for pid, d in sane.items():
            assert put(http, 0, pid, d).status_code == 200
        wait_closed(http, 0)
        assert not events(http, "merge_failed")  # no roll back
        for n, t in c.service.inspect().weights.items():
            torch.testing.assert_close(t, theta0[n] - (sane["a"][n] + sane["b"][n] + sane["c"][n]) / 3)
        assert_model_finite(c, http, 1)


@pytest.mark.parametrize("heavy_first", [False, True])
def test_a_huge_token_claim_counts_as_the_schedule_and_its_share_is_capped(tmp_path: Path, heavy_first: bool) -> None:
    """tokens=2**62 took the whole merge. It counts as the round's bound (H x batch x seq_len x
    slack), and its share is capped at max_share (1/2): the others share the rest by weight.
    First (written straight into the sum, which then waits for the others) or last (it waits)."""
    cfg = tiny_config(outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abc":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = {pid: deltas(c, i) for i, pid in enumerate("abc")}
        order = ["c", "a", "b"] if heavy_first else ["a", "b", "c"]
        for pid in order:
            r = put(http, 0, pid, ds[pid], tokens=2**62 if pid == "c" else 100)
            assert r.status_code == 200, r.text
            if pid == "c":
                assert r.json()["tokens_counted"] == BOUND and f"counted as {BOUND:,}" in r.json()["tokens_reason"]
        wait_closed(http, 0)
        # raw shares 100 : 100 : 20,480; c capped at 1/2, a and b share the other half 1:1
        assert last_weights(http) == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.5})
        for n, t in c.service.inspect().weights.items():
            want = theta0[n] - (0.25 * ds["a"][n] + 0.25 * ds["b"][n] + 0.5 * ds["c"][n])
            torch.testing.assert_close(t, want)
        status = http.get("/v1/status").json()
        assert {p["id"]: p["tokens"] for p in status["participants"]} == {"a": 100, "b": 100, "c": BOUND}
        assert [e["participant_id"] for e in events(http, "tokens")] == ["c"]
        cap = events(http, "cap")
        assert [e["participant_id"] for e in cap] == ["c"] and "capped at 0.5 (max_share 0.5)" in cap[0]["message"]


def test_a_cap_below_one_half_keeps_every_update_until_the_close(tmp_path: Path) -> None:
    """max_share 0.3 of four: d's 20,480 of 20,780 tokens is cut to 0.3, the others have 0.7 / 3."""
    cfg = tiny_config(outer={"algorithm": "fedavg", "max_share": 0.3})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abcd":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = {pid: deltas(c, i) for i, pid in enumerate("abcd")}
        for pid, d in ds.items():
            assert put(http, 0, pid, d, tokens=BOUND if pid == "d" else 100).status_code == 200
            if pid != "d":
                assert c.service.inspect().sum_count == 0  # on disk, not in the sum, until the close
        wait_closed(http, 0)
        weights = last_weights(http)
        assert weights == pytest.approx({"a": 0.7 / 3, "b": 0.7 / 3, "c": 0.7 / 3, "d": 0.3})
        for n, t in c.service.inspect().weights.items():
            want = theta0[n] - sum(weights[p] * ds[p][n] for p in "abcd")
            torch.testing.assert_close(t, want)


def test_a_merge_that_overflows_in_the_outer_step_is_not_committed(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The second line, on its own: with the per-update value bound switched off (a fault on
    purpose), c's 3e38 is merged and FedAdam's g² overflows. The merge is checked before it is
    published: not committed, the optimizer back at the committed round, c (the update that
    moves the merge most) refused for the round with an event, and the round closes with a, b."""
    monkeypatch.setattr("fedtrain.coordinator.intake.values.MAX_UPDATE_ABS", float("inf"))
    # The deadline closes the round with a and b once c is barred (c stays active); 4 s, so that
    # the three uploads are in before it on a loaded machine (1 s failed a CI run under load).
    cfg = tiny_config(outer={"algorithm": "fedadam"}, min_participants=2, round_timeout_s=4.0)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abc":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = {"a": deltas(c, 1), "b": deltas(c, 2), "c": filled(c, BIG)}
        for pid, d in ds.items():
            assert put(http, 0, pid, d).status_code == 200
        deadline = time.monotonic() + 20
        # the event comes first, then the reload of the committed round, then the round opens again
        while not events(http, "merge_refused") or http.get("/v1/status").json()["closing"]:
            assert time.monotonic() < deadline, http.get("/v1/events").json()
            time.sleep(0.05)
        refused = events(http, "refuse")
        assert [e["participant_id"] for e in refused] == ["c"] and "not finite" in refused[0]["message"]
        assert http.get("/v1/rounds/0").json()["current_round"] == 0  # not committed
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(t, theta0[n]), n  # the weights are the committed round's again
        err = assert_error(put(http, 0, "c", ds["c"]), 422, "update_refused")
        assert "not finite" in err["message"]
        for pid in "ab":
            assert put(http, 0, pid, ds[pid]).status_code == 200
        wait_closed(http, 0)
        assert last_weights(http) == pytest.approx({"a": 0.5, "b": 0.5})
        reference = OuterOptimizer(theta0, "fedadam", outer_defaults(cfg))  # fresh moments: none were kept
        reference.step({n: (ds["a"][n] + ds["b"][n]) / 2 for n in theta0})
        for n, t in c.service.inspect().weights.items():
            torch.testing.assert_close(t, reference.params[n])
        assert_model_finite(c, http, 1)
