"""Going back to a kept version (#18, operator mistakes 3 and 4).

An admin can roll the run back to a kept checkpoint (API and CLI): the open round closes with
no updates and the next version holds the kept version's weights and outer state, durably,
as a round and an event. A damaged newest checkpoint no longer leaves the operator stuck: the
refusal says the file is damaged on disk and names the newest intact kept version, and
`--recover` resumes from it (an event)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator, Coordinator
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.errors import StateError
from tests.helpers import zygote
from tests.helpers.api import assert_error, client, put, rand_like, wait_round
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

TOKENS = Tokens([PTOKEN], ATOKEN)


def run_rounds(c: BackgroundCoordinator, first: int, n: int) -> None:
    """Rounds first..first+n-1, each one upload from participant "a" (admin acts for it)."""
    with client(c, ATOKEN) as admin:
        for r in range(first, first + n):
            assert put(admin, r, "a", rand_like(c, r)).status_code == 200
            wait_round(admin, r)


def model_at(c: BackgroundCoordinator, version: int | None = None) -> dict[str, torch.Tensor]:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient

    with CoordinatorClient(c.url, PTOKEN) as fetcher:
        got, tensors = fetcher.download(version=version)
    assert version is None or got == version
    return tensors


def test_an_admin_rolls_the_run_back_to_a_kept_version(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tiny_config(rounds=0, outer={"algorithm": "fedavg"}, keep_checkpoints=3)
    with BackgroundCoordinator(state, cfg, tokens=TOKENS) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
        run_rounds(c, 0, 3)  # versions 1, 2, 3
        kept_model = model_at(c, 2)
        with client(c, ATOKEN) as admin, client(c) as participant:
            assert_error(participant.post("/v1/admin/rollback", json={"version": 2}), 403, "admin_only")
            kept = admin.get("/v1/admin/checkpoints").json()
            assert 2 in kept["versions"] and kept["committed_version"] == 3
            assert_error(admin.post("/v1/admin/rollback", json={"version": 0}), 404, "version_not_kept")
            r = admin.post("/v1/admin/rollback", json={"version": 2})
            assert r.status_code == 200, r.text
            assert r.json() == {"version": 4, "restored": 2}
            status = admin.get("/v1/status").json()
            assert status["current_round"] == 4
            events = admin.get("/v1/events").json()["events"]
            assert any(e["kind"] == "rollback" and "version 2" in e["message"] for e in events), events
        now = model_at(c, 4)
        for n, t in kept_model.items():
            torch.testing.assert_close(now[n], t, rtol=0, atol=0)
        assert "rolled back to version 2" in c.service.round_history(1)[0]["close_reason"]
        run_rounds(c, 4, 1)  # the run goes on from the restored weights
    with BackgroundCoordinator(state, cfg, tokens=TOKENS) as c:  # and it was durable
        assert c.service.version == 5


def test_a_roll_back_that_comes_while_a_round_closes_waits_for_it(tmp_path: Path) -> None:
    """A roll back during a close (here a merge slowed on purpose) is not refused: it waits
    for the close to end, then goes back; the round that closed meanwhile stays committed."""
    from fedtrain import faults

    cfg = tiny_config(rounds=0, outer={"algorithm": "fedavg"}, keep_checkpoints=3)
    with BackgroundCoordinator(tmp_path / "state", cfg, tokens=TOKENS) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
        run_rounds(c, 0, 1)  # version 1
        with faults.inject("merge.before_step", "sleep", seconds=1.5, round=1), client(c, ATOKEN) as admin:
            assert put(admin, 1, "a", rand_like(c, 1)).status_code == 200  # round 1 closes: its merge sleeps
            assert c.service.status()["closing"]
            r = admin.post("/v1/admin/rollback", json={"version": 1})
            assert r.status_code == 200, r.text
            assert r.json() == {"version": 3, "restored": 1}  # round 1 committed as version 2 first
        assert [row["round"] for row in c.service.round_history(3)] == [2, 1, 0]
        now, kept = model_at(c, 3), model_at(c, 1)
        for n, t in kept.items():
            torch.testing.assert_close(now[n], t, rtol=0, atol=0)


def test_the_cli_lists_and_rolls_back(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=0, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "state", cfg, tokens=TOKENS) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
        run_rounds(c, 0, 2)
        env = {**os.environ, "FEDTRAIN_ADMIN_TOKEN": ATOKEN, "FEDTRAIN_TOKEN": ""}
        argv = [sys.executable, "-m", "fedtrain", "rollback", "--coordinator", c.url]
        listed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert listed.returncode == 0 and "kept versions (newest first): 2, 1" in listed.stdout, listed
        done = subprocess.run([*argv, "--version", "1"], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0 and "version 3 holds the weights" in done.stdout, done
        missing = subprocess.run([*argv, "--version", "9"], capture_output=True, text=True, env=env, timeout=60)
        assert missing.returncode == 2 and "not a kept checkpoint" in missing.stderr
        assert len(missing.stderr.strip().splitlines()) == 1


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a flipped bit in the tensor data
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_names_the_intact_one_and_recover_resumes_from_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tiny_config(rounds=0, outer={"algorithm": "fedavg"}, keep_checkpoints=3)
    with BackgroundCoordinator(state, cfg, tokens=TOKENS) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
        run_rounds(c, 0, 2)  # versions 1 and 2
        intact = model_at(c, 1)
        newest = c.service.inspect().checkpoints.global_path(2)
    damage(newest)

    with pytest.raises(StateError) as refused:
        Coordinator(state, cfg, TOKENS).open()
    msg = refused.value.message
    assert "damaged on disk" in msg and "transit" not in msg
    assert "newest intact kept version is 1" in msg and "--recover" in msg

    cli = zygote.run(  # the operator's view: one line, exit 2, what to do
        [sys.executable, "-m", "fedtrain", "coordinator", "--state-dir", str(state), "--port", "0"],
        text=True, timeout=120,
        env={**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": ATOKEN},
    )
    assert cli.returncode == 2 and "--recover" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli

    svc = Coordinator(state, cfg, TOKENS, recover=True)
    svc.open()
    try:
        assert svc.version == 3 and svc.inspect().committed_version == 3
        for n, t in intact.items():
            torch.testing.assert_close(svc.inspect().weights[n], t, rtol=0, atol=0)
        events = svc.event_log(20)
        assert any(e["kind"] == "recover" and "version 1" in e["message"] for e in events)
    finally:
        svc.store.close()
        svc.lock.release()  # type: ignore[union-attr]
    with BackgroundCoordinator(state, cfg, tokens=TOKENS) as c:  # a plain restart works from now on
        assert c.service.version == 3
        run_rounds(c, 3, 1)
