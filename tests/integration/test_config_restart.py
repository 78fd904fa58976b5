"""The config across restarts and reloads (#18, operator mistakes 2 and 3).

Restarting a crashed coordinator with the command that started the run must not undo the
live changes made since: the stored config wins, the differences are printed, and
`--apply-config` applies the file as a new version with its true diff. SIGHUP applies what
changed in the file and keeps live changes the file does not make, saying so. A switch of
`outer.algorithm` takes the new algorithm's own defaults."""

from __future__ import annotations

import itertools
import json
import signal
import sqlite3
from pathlib import Path

import httpx
import yaml

from fedtrain.config import RunConfig, outer_defaults
from fedtrain.config.changes import apply_change, change_notes, config_diff
from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator, wait_for

ADMIN = {"Authorization": "Bearer admin"}


def history(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/config/history", headers=ADMIN).json()["versions"]


def config_now(url: str) -> dict:
    return httpx.get(f"{url}/v1/config", headers=ADMIN).json()["config"]


def assert_true_diffs(state: Path) -> None:
    """Every stored version's recorded diff is exactly what changed from the version before it."""
    with sqlite3.connect(state / "run.db") as db:
        rows = db.execute("SELECT version, config, diff FROM config_versions ORDER BY version").fetchall()
    for (_, before, _), (version, after, diff) in itertools.pairwise(rows):
        assert json.loads(diff) == config_diff(json.loads(before), json.loads(after)), version


def test_a_restart_with_the_same_file_keeps_the_live_changes(tmp_path: Path) -> None:
    path, state, log = tmp_path / "run.yaml", tmp_path / "state", tmp_path / "coordinator.log"
    path.write_text(yaml.safe_dump(tiny_config(rounds=0).model_dump(mode="json")))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_coordinator(path, state, port, log)
    try:
        r = httpx.put(f"{url}/v1/config", headers=ADMIN, json={"changes": {"train": {"sync_every": 20}}})
        assert r.status_code == 200, r.text
    finally:
        stop_coordinator(proc)

    proc = start_coordinator(path, state, port, log)  # the command that started the run
    try:
        assert config_now(url)["train"]["sync_every"] == 20  # the live change survived
        h = history(url)
        versions = len(h)
        assert versions == 2 and all(v["diff"] for v in h[:-1]), h  # no new version, none with an empty diff
        text = log.read_text()
        assert "differs from the config this run has stored" in text and "--apply-config" in text
        assert "train.sync_every: 20 (stored) vs 5 (file)" in text
    finally:
        stop_coordinator(proc)

    proc = start_coordinator(path, state, port, log, "--apply-config")
    try:
        assert config_now(url)["train"]["sync_every"] == 5
        newest = history(url)[0]
        assert len(history(url)) == versions + 1
        assert newest["author"] == "start --apply-config" and newest["diff"] == {"train.sync_every": [20, 5]}
    finally:
        stop_coordinator(proc)
    assert_true_diffs(state)


def test_sighup_applies_the_files_edits_and_keeps_other_live_changes(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=0).model_dump(mode="json")
    path, state = tmp_path / "run.yaml", tmp_path / "state"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_coordinator(path, state, port, tmp_path / "coordinator.log")
    try:
        r = httpx.put(f"{url}/v1/config", headers=ADMIN, json={"changes": {"outer": {"lr": 0.5}}})
        assert r.status_code == 200, r.text
        cfg["train"]["sync_every"] = 7  # the operator edits another field in the file
        path.write_text(yaml.safe_dump(cfg))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: config_now(url)["train"]["sync_every"] == 7)
        now = config_now(url)
        assert now["outer"]["lr"] == 0.5  # the live change the file does not make is kept
        assert history(url)[0]["diff"] == {"train.sync_every": [5, 7]}
        events = httpx.get(f"{url}/v1/events", headers=ADMIN).json()["events"]
        assert any("kept the live changes to outer.lr" in e["message"] for e in events), events
    finally:
        stop_coordinator(proc)
    assert_true_diffs(state)


def test_switching_the_algorithm_takes_its_defaults_and_says_which() -> None:
    diloco = RunConfig.model_validate({"outer": {"algorithm": "diloco", "lr": 0.7, "momentum": 0.9}})
    new, diff = apply_change(diloco, {"outer": {"algorithm": "fedadam"}})
    assert outer_defaults(new)["lr"] == 1e-2 and outer_defaults(new)["momentum"] == 0.0
    assert diff == {"outer.algorithm": ["diloco", "fedadam"], "outer.lr": [0.7, None], "outer.momentum": [0.9, None]}
    assert "lr 0.01" in change_notes(diloco, new)[0]
    given, _ = apply_change(diloco, {"outer": {"algorithm": "fedadam", "lr": 0.05}})  # its own lr is kept
    assert outer_defaults(given)["lr"] == 0.05 and "lr 0.05 (given)" in change_notes(diloco, given)[0]
    same, _ = apply_change(diloco, {"outer": {"lr": 0.5}})  # no switch: nothing else moves
    assert same.outer.momentum == 0.9 and change_notes(diloco, same) == []


def test_the_validation_answer_says_what_a_switch_runs_with(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "diloco", "lr": 0.7})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        headers = {"Authorization": f"Bearer {ATOKEN}"}
        switch = {"changes": {"outer": {"algorithm": "fedadam"}}}
        v = httpx.post(f"{c.url}/v1/config/validate", headers=headers, json=switch)
        assert v.status_code == 200 and v.json()["valid"], v.text
        assert v.json()["diff"]["outer.lr"] == [0.7, None]
        assert any("fedadam" in n and "lr 0.01" in n for n in v.json()["notes"]), v.json()
        r = httpx.put(f"{c.url}/v1/config", headers=headers, json=switch)
        assert r.status_code == 200 and r.json()["notes"], r.text
        status = c.service.status()
        assert status["algorithm"] == "fedadam" and status["outer_lr"] == 1e-2  # in force at once (idle)
