"""Asynchronous mode over loopback (`schedule.mode: async`): every update is applied as it
arrives, each one a committed version; an update is scaled by its staleness, refused beyond
max_staleness, idempotent across rounds; participants of different speeds all contribute
and the loss falls; a coordinator killed right after committing a version resumes with it;
and a run switches from rounds to asynchronous mode at a round boundary."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.wire import DIGEST_HEADER
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator
from tests.helpers.runs import heldout_loss, recipe_gpt
from tests.helpers.tiny import Regression, Small, TinyGPT, TinyParticipant, init_file, join_all, run_all

ASYNC = {"mode": "async"}


def small_delta(c: BackgroundCoordinator, value: float = 0.01) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, value) for n, t in c.service.inspect().weights.items()}


def wait_committed(c: BackgroundCoordinator, version: int) -> None:
    deadline = time.monotonic() + 20
    while c.service.inspect().committed_version < version:
        assert time.monotonic() < deadline, f"version {version} never committed"
        time.sleep(0.02)


def test_each_update_is_a_version_scaled_by_its_staleness(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=0, schedule=ASYNC, asynchronous={"max_staleness": 1})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for name in "abc":
            http.post("/v1/join", json={"name": name})
        delta = small_delta(c)
        first = put(http, 0, "a", delta).json()
        assert first == {"accepted": True, "duplicate": False, "round": 0, "applied_in": 0, "staleness": 0}
        wait_committed(c, 1)
        # a's upload sent again (its answer lost): already applied, not applied twice
        assert put(http, 0, "a", delta).json()["duplicate"] is True
        second = put(http, 0, "b", delta).json()  # trained from version 0, applied to version 1
        assert (second["applied_in"], second["staleness"]) == (1, 1)
        wait_committed(c, 2)
        err = assert_error(put(http, 0, "c", delta), 409, "too_stale")  # 2 behind, max_staleness 1
        assert err["details"]["current_round"] == 2 and "max_staleness 1" in err["message"]
        piece = http.put("/v1/rounds/2/updates/c", params={"tokens": 10, "piece": "rank0"}, content=b"x",
                         headers={DIGEST_HEADER: "sha256:" + "0" * 64})
        assert_error(piece, 409, "pieces_not_async")
        # two at once: each gets a version of its own
        answers: list[dict] = []

        def upload(name: str) -> None:
            with client(c, ATOKEN) as own:
                answers.append(put(own, 2, name, delta).json())

        uploads = [threading.Thread(target=upload, args=(n,)) for n in "ac"]
        for t in uploads:
            t.start()
        for t in uploads:
            t.join(30)
        assert sorted((a["applied_in"], a["staleness"]) for a in answers) == [(2, 0), (3, 1)]
        wait_committed(c, 4)
        status = http.get("/v1/status").json()
    assert status["mode"] == "async" and status["algorithm"] == "delayed_nesterov"
    rounds = sorted(status["recent_rounds"], key=lambda r: r["round"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert all(r["n_submissions"] == 1 for r in rounds)
    assert rounds[1]["submissions"] == [{"participant_id": "b", "tokens": 100, "weight": 2**-0.5,
                                         "bytes": rounds[1]["submissions"][0]["bytes"]}]
    assert "b's update (trained from version 0, staleness 1, weight x0.707" in rounds[1]["close_reason"]
    parts = {p["id"]: p for p in status["participants"]}
    assert parts["b"]["staleness"] == 1 and parts["b"]["applied"] == 1
    assert parts["a"]["applied"] == 2 and sum(p["share"] for p in parts.values()) == pytest.approx(1.0)


def test_a_stale_update_brings_its_participant_the_version_it_made(tmp_path: Path) -> None:
    # While "solo" trains from version 0, another update makes version 1; solo's update is
    # applied to version 1 (staleness 1), whose merge is slowed down. Solo waits for that round
    # (`applied_in`), not for round 0 (closed long ago), so its download brings version 2.
    cfg = tiny_config(rounds=3, schedule=ASYNC, train={"sync_every": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c, \
            client(c, ATOKEN) as http:
        http.post("/v1/join", json={"name": "other"})

        def another_update_meanwhile(fed: object, loss: float) -> None:
            if c.service.version == 0 and not c.service.inspect().submitted:
                assert put(http, 0, "other", small_delta(c)).status_code == 200
                wait_committed(c, 1)

        with faults.inject("merge.before_step", "sleep", seconds=1.0, round=1):
            (solo,) = run_all([TinyParticipant(c.url, "solo", Regression(rows=16, seed=0),
                                               on_step=another_update_meanwhile)])
    assert solo.fed is not None and [h["round"] for h in solo.fed.history] == [0, 2]
    assert solo.fed.round == 3


def test_participants_of_different_speeds_all_contribute_and_the_loss_falls(tmp_path: Path) -> None:
    rounds = 30
    cfg = tiny_config(rounds=rounds, schedule=ASYNC, asynchronous={"max_staleness": 64},
                      train={"sync_every": 10, "lr": 1e-2})
    sleeps = [0.0, 0.02, 0.05]  # p2 sleeps in its inner loop: the slowest, p0 the fastest
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        runners = run_all([TinyParticipant(c.url, f"p{i}", recipe_gpt(i, 3), step_sleep_s=s)
                           for i, s in enumerate(sleeps)])
        with CoordinatorClient(c.url, PTOKEN) as cl:
            status = cl.status()
            version, final = cl.download()
    assert status["finished"] and version == rounds
    recent = sorted(r["round"] for r in status["recent_rounds"])  # (status shows the newest 20)
    assert recent == list(range(rounds - 20, rounds)) and all(r["n_submissions"] == 1 for r in status["recent_rounds"])
    applied = {p["id"]: p["applied"] for p in status["participants"]}
    assert sum(applied.values()) == rounds and all(n >= 1 for n in applied.values()), applied
    assert applied["p0"] > applied["p2"], applied  # the fast one contributes more updates
    assert all(p["staleness"] is not None for p in status["participants"])
    assert heldout_loss(final) < initial - 1.0
    for r in runners:  # every participant ends on the final global model
        for name, t in final.items():
            assert torch.equal(r.weights[name], t), (r.name, name)


def test_a_coordinator_killed_after_committing_a_version_resumes_with_it(tmp_path: Path) -> None:
    rounds = 12
    cfg = tiny_config(rounds=rounds, schedule=ASYNC, train={"sync_every": 10})
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    state, log, port = tmp_path / "state", tmp_path / "coordinator.log", free_port()
    url = f"http://127.0.0.1:{port}"
    # killed right after the database commit of version 5 (round 4), before anything else
    proc = start_coordinator(cfg_path, state, port, log, env={"FEDTRAIN_FAULTS": "commit.after_db:kill:round=4"})
    runners = [TinyParticipant(url, f"p{i}", recipe_gpt(i, 3), step_sleep_s=0.01 * i) for i in range(3)]
    try:
        for r in runners:
            r.start()
        assert proc.wait(timeout=120) == -signal.SIGKILL, log.read_text()[-3000:]
        time.sleep(1.0)
        proc = start_coordinator(cfg_path, state, port, log)
        join_all(*runners)
        with CoordinatorClient(url, PTOKEN) as cl:
            status = cl.status()
            version, final = cl.download()
            events = [e["message"] for e in cl.recent_events()]
    finally:
        stop_coordinator(proc)
    assert status["finished"] and version == rounds
    assert any(m.startswith("resumed at round 5 (last committed)") for m in events), events  # version 5 kept
    committed = sorted(r["round"] for r in status["recent_rounds"])
    assert committed == list(range(rounds)), committed  # no committed version lost or repeated
    assert all(r["n_submissions"] == 1 for r in status["recent_rounds"])
    for r in runners:
        for name, t in final.items():
            assert torch.equal(r.weights[name], t), (r.name, name)


def test_a_run_switches_from_rounds_to_async_at_a_round_boundary(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=12, train={"sync_every": 5}, min_participants=3)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        runners = [TinyParticipant(c.url, f"p{i}", TinyGPT(shard=i, of=3, batch_size=4)) for i in range(3)]
        for p in runners:
            p.start()
        deadline = time.monotonic() + 120
        while c.service.version < 2:
            assert time.monotonic() < deadline and not any(p.error for p in runners)
            time.sleep(0.01)
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
            checked = http.post("/v1/config/validate", json={"changes": {"schedule": ASYNC}}).json()
            r = http.put("/v1/config", json={"changes": {"schedule": ASYNC}}).json()
        join_all(*runners)
        status = c.service.status()
        events = [e["message"] for e in c.service.event_log(500)]
    switch = r["effective_round"]
    assert any("schedule.mode rounds -> async" in n for n in checked.get("notes", [])), checked
    by_round = {x["round"]: x for x in status["recent_rounds"]}
    assert all(by_round[k]["n_submissions"] == 3 for k in range(switch))  # lockstep rounds before
    assert all(by_round[k]["n_submissions"] == 1 for k in range(switch, 12))  # one update per version after
    assert status["mode"] == "async" and status["algorithm"] == "delayed_nesterov"
    assert any("switched to delayed_nesterov with its momentum kept" in m for m in events), events
