"""A round's model is served while its checkpoint is written. When that background commit
fails (a fault, a full disk), the coordinator goes back to the last committed round at once;
with publish_first, participants that already trained on the lost model follow it back and
finish the run, and commit first their downloads of it are cut short."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator, Tokens
from tests.helpers.api import delta, download, upload
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.runs import assert_all_on, train_all


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def back_at_round_0_then_commit_it(c: BackgroundCoordinator, http: httpx.Client,
                                   theta0: dict[str, torch.Tensor]) -> None:
    """After a failed commit of round 0: the served model is the committed one again, and
    round 0, open again, commits this time (FedAvg of two known deltas)."""
    version, theta = download(http)
    assert version == 0
    for n, t in theta.items():
        assert torch.equal(t, theta0[n])
    da, db = delta(theta0, 0, 0), delta(theta0, 1, 0)
    for pid, d in (("a", da), ("b", db)):
        assert upload(http, 0, pid, d).status_code == 200
    wait_for(lambda: c.service.inspect().committed_version == 1, "round 0 did not commit on the second try")
    version, theta = download(http)
    assert version == 1
    for n, t in theta.items():
        torch.testing.assert_close(t, theta0[n] - (da[n] + db[n]) / 2, rtol=0, atol=1e-6)


@contextlib.contextmanager
def two_joined(tmp_path: Path, cfg: RunConfig) -> Iterator[tuple[BackgroundCoordinator, httpx.Client, dict]]:
    """A coordinator that "a" and "b" joined, a client of theirs, and the weights of version 0."""
    headers = {"Authorization": f"Bearer {PTOKEN}"}
    with BackgroundCoordinator(tmp_path / "state", cfg, tokens=Tokens([PTOKEN], "admin")) as c, \
            httpx.Client(base_url=c.url, headers=headers, timeout=30) as http:
        for pid in ("a", "b"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
        _, theta0 = download(http)
        yield c, http, theta0


def send_round_0(http: httpx.Client, theta0: dict) -> None:
    """Both send their update for round 0."""
    for who, pid in enumerate(("a", "b")):
        assert upload(http, 0, pid, delta(theta0, who, 0)).status_code == 200


def test_failed_background_commit_goes_back_to_the_committed_round(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=5, outer={"algorithm": "fedavg"}, publish_first=True, min_participants=2)
    with two_joined(tmp_path, cfg) as (c, http, theta0):
        rule = faults.arm(faults.Rule("commit.before_db", "raise", round=0))
        try:
            send_round_0(http, theta0)
            wait_for(lambda: rule.fired == 1, "the commit of round 0 never ran")
            wait_for(lambda: c.service.version == 0 and not c.service.status()["closing"], "no roll back")
        finally:
            faults.disarm()
        assert c.service.inspect().committed_version == 0
        kinds = [e["kind"] for e in http.get("/v1/events", params={"limit": 20}).json()["events"]]
        assert "commit_failed" in kinds
        back_at_round_0_then_commit_it(c, http, theta0)


@pytest.mark.parametrize("publish_first", [True, False])
def test_participants_follow_a_lost_round_back_and_finish(tmp_path: Path, publish_first: bool) -> None:
    """The commit of round 1 fails. With publish_first the participants took its model and
    trained on it: their round-2 state is gone, they go back to round 1's start. Commit first,
    their downloads of it are cut short and they fetch the committed model again. Either way
    the run still finishes."""
    cfg = tiny_config(rounds=4, publish_first=publish_first, train={"sync_every": 5, "lr": 1e-2})
    rule = faults.arm(faults.Rule("commit.before_db", "raise", round=1))
    try:
        with BackgroundCoordinator(tmp_path / "state", cfg) as c:
            results = train_all(c.url, 2)
            wait_for(lambda: c.service.inspect().committed_version == 4, "the run's last round never committed")
            final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
            rounds = c.service.round_history()
            kinds = [e["kind"] for e in c.service.event_log(limit=200)]
    finally:
        faults.disarm()
    assert rule.fired == 1
    assert "commit_failed" in kinds
    assert sorted(r["round"] for r in rounds) == [0, 1, 2, 3]
    assert_all_on(results, final)


def test_a_full_disk_during_the_commit_goes_back_and_the_round_commits_once_there_is_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's direct writes fail with ENOSPC (commit first): the commit fails, its
    temp files go, the run goes back to the last committed round; with room again the
    round is sent again and commits."""
    import errno
    import os

    cfg = tiny_config(rounds=5, outer={"algorithm": "fedavg"}, min_participants=2)
    real = os.pwrite
    full = {"on": False, "refused": 0}

    def pwrite(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        if full["on"]:
            full["refused"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with two_joined(tmp_path, cfg) as (c, http, theta0):
        full["on"] = True
        send_round_0(http, theta0)
        wait_for(lambda: full["refused"] > 0, "the commit of round 0 never wrote")
        wait_for(lambda: c.service.version == 0 and not c.service.status()["closing"], "no roll back")
        full["on"] = False
        assert c.service.inspect().committed_version == 0
        left = [p.name for p in (tmp_path / "state" / "checkpoints").glob("*.tmp")]
        assert all(name.startswith(".spare-") for name in left), left  # the failed writes' temp files went
        events = http.get("/v1/events", params={"limit": 20}).json()["events"]
        assert any(e["kind"] == "commit_failed" and "No space" in e["message"] for e in events), events
        back_at_round_0_then_commit_it(c, http, theta0)


def test_a_full_disk_that_also_fills_the_database_holds_the_run_with_507_then_lets_it_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills in the middle of a commit, and SQLite cannot write either: the roll back
    used to raise on its first event write and left the round `closing` for good (uploads 409,
    downloads 404) until a restart. Now the run waits for room with uploads answered 507 (what
    to do, not an internal error), then goes back to the open round 0 and commits it."""
    import errno
    import os
    import sqlite3

    from fedtrain.coordinator.state.store import Store

    cfg = tiny_config(rounds=5, outer={"algorithm": "fedavg"}, min_participants=2)
    real_pwrite, real_write = os.pwrite, Store.write
    full = {"armed": False, "on": False, "db": 0}

    def pwrite(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        if full["armed"]:  # the disk fills as the checkpoint is written
            full["on"] = True
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    @contextlib.contextmanager
    def write(self):  # type: ignore[no-untyped-def]
        if full["on"]:
            full["db"] += 1
            raise sqlite3.OperationalError("database or disk is full")
        with real_write(self) as db:
            yield db

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(Store, "write", write)
    with two_joined(tmp_path, cfg) as (c, http, theta0):
        full["armed"] = True
        send_round_0(http, theta0)
        wait_for(lambda: full["db"] > 1, "the database never refused a write")
        r = upload(http, 0, "a", delta(theta0, 0, 0))  # meanwhile: told to retry, not a 500 or 'closing'
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", r.text
        assert "disk is full" in r.json()["error"]["message"] and r.headers["Retry-After"]
        full["armed"] = full["on"] = False  # room again
        wait_for(lambda: c.service.version == 0 and not c.service.status()["closing"],
                 "no going back once there was room")
        assert c.service.inspect().committed_version == 0
        events = http.get("/v1/events", params={"limit": 20}).json()["events"]
        assert any(e["kind"] == "storage" and "room on the disk again" in e["message"] for e in events), events
        back_at_round_0_then_commit_it(c, http, theta0)
