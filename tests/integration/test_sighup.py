"""SIGHUP makes a coordinator re-read its config file: a valid file becomes a new config
version (author "file"); an invalid one is refused with its reason and nothing changes."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import yaml

from tests.helpers.config import tiny_config
from tests.helpers.processes import free_port, wait_for
from tests.helpers.processes import start_coordinator as start


def test_sighup_reloads_config_file(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=5).model_dump(mode="json")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = start(path, tmp_path / "state", port, tmp_path / "log.txt")
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer admin"}
    try:
        cfg["train"]["sync_every"] = 11
        path.write_text(yaml.safe_dump(cfg))
        proc.send_signal(signal.SIGHUP)
        view = wait_for(lambda: (v := httpx.get(f"{url}/v1/config", headers=headers).json())["version"] == 2 and v)
        assert view["config"]["train"]["sync_every"] == 11
        history = httpx.get(f"{url}/v1/config/history", headers=headers).json()["versions"]
        assert history[0]["author"] == "file" and history[0]["diff"] == {"train.sync_every": [5, 11]}

        path.write_text("train:\n  sync_every: -3\n")
        proc.send_signal(signal.SIGHUP)

        def refused() -> bool:
            events = httpx.get(f"{url}/v1/events", headers=headers).json()["events"]
            return any("refused" in e["message"] and "train.sync_every" in e["message"] for e in events)

        wait_for(refused)
        assert httpx.get(f"{url}/v1/config", headers=headers).json()["version"] == 2
        assert proc.poll() is None  # a bad file never stops a running coordinator
    finally:
        proc.terminate()
        proc.wait(timeout=30)
