"""Live configuration: versioned changes by the admin, pushed over SSE, applied by every
participant at the same round boundary; invalid and fixed-field changes refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient, Participant
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.tiny import TinyGPT, TinyParticipant, join_all


def admin(c: BackgroundCoordinator) -> httpx.Client:
    return httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30)


def test_change_validation_and_roles(coordinator: BackgroundCoordinator) -> None:
    with admin(coordinator) as http, httpx.Client(
        base_url=coordinator.url, headers={"Authorization": f"Bearer {PTOKEN}"}
    ) as part:
        assert part.get("/v1/config").json()["version"] == 1
        r = part.put("/v1/config", json={"changes": {"train": {"sync_every": 9}}})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
        r = http.put("/v1/config", json={"changes": {"model": {"n_layer": 7}}})
        assert r.status_code == 422 and "model.n_layer cannot change" in r.json()["error"]["message"]
        r = http.put("/v1/config", json={"changes": {"train": {"lr": -1}}})
        assert r.status_code == 422 and "train.lr" in r.json()["error"]["message"]
        assert http.get("/v1/config").json()["version"] == 1  # the running version stays
        v = http.post("/v1/config/validate", json={"changes": {"train": {"sync_every": 0}}}).json()
        assert v["valid"] is False and "train.sync_every" in v["error"]
        v = http.post("/v1/config/validate", json={"changes": {"train": {"sync_every": 3}}}).json()
        assert v == {"valid": True, "error": None, "diff": {"train.sync_every": [5, 3]}, "notes": []}
        # no participant yet: the change is in force at once
        r = http.put("/v1/config", json={"changes": {"train": {"sync_every": 3}}}).json()
        assert r["version"] == 2 and r["effective_round"] == 0
        view = part.get("/v1/config").json()
        assert view["version"] == 2 and view["config"]["train"]["sync_every"] == 3
        [latest, *_] = http.get("/v1/config/history").json()["versions"]
        assert latest["author"] == "admin" and latest["diff"] == {"train.sync_every": [5, 3]}


def test_sse_stream_pushes_config_changes(coordinator: BackgroundCoordinator) -> None:
    got: list = []
    client = CoordinatorClient(coordinator.url, PTOKEN)

    def follow() -> None:
        for kind, data in client.events():
            got.append((kind, data))
            if kind == "config_change":
                return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got and got[0][0] == "hello"
    with admin(coordinator) as http:
        http.put("/v1/config", json={"changes": {"outer": {"lr": 0.5}}})
    t.join(timeout=10)
    kinds = [k for k, _ in got]
    assert "config_change" in kinds, kinds
    change = dict(got)["config_change"]
    assert change["diff"] == {"outer.lr": [None, 0.5]} and change["version"] == 2
    client.close()
    # EventSource cannot set headers: the token may come as a query parameter
    with httpx.stream("GET", f"{coordinator.url}/v1/stream", params={"token": "nope"}) as r:
        assert r.status_code == 401


def live_participant(url: str, i: int) -> tuple[TinyParticipant, list]:
    """Participant i of 3 (batches of 4 x 32 tokens), and the config changes it saw: (round, fields)."""
    changes: list = []

    def follow(fed: Participant) -> None:
        fed.on_config_change(lambda old, new, diff: changes.append((fed.round, sorted(diff))))

    return TinyParticipant(url, f"p{i}", TinyGPT(shard=i, of=3, batch_size=4, seq_len=32), on_join=follow), changes


def test_h_and_lr_change_mid_run_switch_at_one_boundary(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=7, train={"sync_every": 5, "lr": 3e-3})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        runners, changes = zip(*(live_participant(c.url, i) for i in range(3)))
        for p in runners:
            p.start()
        while c.service.version < 2 and not any(p.error for p in runners):
            time.sleep(0.01)
        with admin(c) as http:
            r = http.put("/v1/config", json={"changes": {"train": {"sync_every": 8, "lr": 1e-3}}}).json()
        join_all(*runners)
        status = c.service.status()
    effective = r["effective_round"]
    assert 2 <= effective < 7
    for i, p in enumerate(runners):
        assert p.fed is not None
        for rec in p.fed.history:
            expected = 8 if rec["round"] >= effective else 5
            assert rec["steps"] == expected and rec["sync_every"] == expected, (i, rec)
            assert rec["config_version"] == (2 if rec["round"] >= effective else 1)
        assert p.optimizer.param_groups[0]["lr"] == 1e-3
        assert changes[i] == [(effective, ["train.lr", "train.sync_every"])]
    # the coordinator knows the version each participant runs
    assert {p["id"]: p["config_version"] for p in status["participants"]} == {f"p{i}": 2 for i in range(3)}


def test_outer_algorithm_switch_starts_fresh_state(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        svc = c.service
        with admin(c) as http:
            http.post("/v1/join", json={"name": "a"})
            from tests.helpers.api import put, zeros_like_model

            ones = {n: torch.ones_like(t) * 0.01 for n, t in zeros_like_model(c).items()}
            assert put(http, 0, "a", ones).status_code == 200
            http.get("/v1/rounds/0", params={"wait": 10})
            assert svc.status()["algorithm"] == "diloco" and svc.inspect().outer_state
            r = http.put("/v1/config", json={"changes": {"outer": {"algorithm": "fedadam"}}}).json()
            assert r["effective_round"] == 2
            assert put(http, 1, "a", ones).status_code == 200
            http.get("/v1/rounds/1", params={"wait": 10})
            assert svc.version == 2 and svc.status()["algorithm"] == "fedadam" and svc.inspect().outer_steps == 0
            events = [e["message"] for e in svc.event_log()]
            assert any("switched to fedadam with fresh state" in m for m in events), events
    # Version 2 is the outcome of round 1, merged by DiLoCo: its checkpoint holds DiLoCo's
    # state, and the model file the bytes that were served (the switch came in force between
    # the merge and the commit written beside round 2). A restart reads both back.
    with BackgroundCoordinator(tmp_path / "s") as c:
        svc = c.service
        assert svc.version == 2 and svc.status()["algorithm"] == "fedadam" and svc.inspect().outer_steps == 0
        _, meta = svc.inspect().checkpoints.load_outer(2)
        assert meta["algorithm"] == "diloco" and meta["steps"] == "2"
