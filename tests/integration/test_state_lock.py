"""A state directory belongs to one coordinator at a time (#18, operator mistake 1).

A second `fedtrain coordinator` on a live run's state directory used to start silently,
overwrite endpoint.json, store its stale start config as a new version and prune the live
run's checkpoints. It is refused now, before it touches anything, with a message naming the
holder; a holder killed with SIGKILL leaves no lock behind."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from fedtrain.coordinator import BackgroundCoordinator, Coordinator
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import StateError
from tests.helpers import zygote
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator


def snapshot(state: Path) -> dict[str, object]:
    """What a second coordinator must leave alone: every file's bytes but the live database's,
    and the config versions and events the database holds."""
    files = {
        str(p.relative_to(state)): p.read_bytes()
        for p in sorted(state.rglob("*"))
        if p.is_file() and not p.name.startswith("run.db")
    }
    store = Store(state / "run.db")
    try:
        versions = [v["version"] for v in store.config_history()]
        events = [(e["kind"], e["message"]) for e in store.events(1000)]
    finally:
        store.close()
    return {"files": files, "versions": versions, "events": events}


def test_a_second_coordinator_on_a_live_state_dir_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "run.json"
    cfg.write_text(tiny_config(rounds=5).model_dump_json())
    other = tmp_path / "other.json"  # a stale start config: it would become a new version
    other.write_text(tiny_config(rounds=50, train={"sync_every": 9}).model_dump_json())
    first = start_coordinator(cfg, state, free_port(), tmp_path / "first.log")
    try:
        url = json.loads((state / "endpoint.json").read_text())["url"]
        before = snapshot(state)
        second = zygote.run(
            [sys.executable, "-m", "fedtrain", "coordinator", "--config", str(other), "--state-dir", str(state),
             "--port", "0"],
            text=True, timeout=120,
            env={**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": "admin"},
        )
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "in use by another coordinator" in lines[0]
        assert f"pid {first.pid}" in lines[0] and url in lines[0], lines[0]
        assert snapshot(state) == before  # endpoint.json, checkpoints, config versions, events
        assert first.poll() is None
    finally:
        stop_coordinator(first)


def test_the_lock_is_held_for_the_coordinators_life_and_dropped_at_its_stop(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config()):
        with pytest.raises(StateError, match="in use by another coordinator"):
            Coordinator(state, tiny_config()).open()
    again = Coordinator(state, tiny_config())  # stopped: the directory is free again
    again.open()
    again.lock.release()  # type: ignore[union-attr]
    again.store.close()


def test_a_coordinator_killed_with_sigkill_leaves_no_lock_behind(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "run.json"
    cfg.write_text(tiny_config().model_dump_json())
    proc = start_coordinator(cfg, state, free_port(), tmp_path / "first.log")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    restarted = start_coordinator(cfg, state, free_port(), tmp_path / "second.log")
    stop_coordinator(restarted)
