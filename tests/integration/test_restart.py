"""A coordinator killed with SIGKILL mid-run and started again resumes with no committed round
lost; its participants reconnect by themselves and finish on identical weights."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from fedtrain.participant import CoordinatorClient
from tests.conftest import PTOKEN, tiny_config
from tests.integration.test_e2e import train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg_path: Path, state: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": "admin"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedtrain",
            "coordinator",
            "--config",
            str(cfg_path),
            "--state-dir",
            str(state),
            "--port",
            str(port),
        ],
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
    raise AssertionError("coordinator did not start: " + log.read_text())


def current_round(url: str) -> int:
    return httpx.get(f"{url}/v1/healthz", timeout=5).json()["current_round"]


def test_sigkill_coordinator_resumes_without_losing_rounds(tmp_path: Path) -> None:
    rounds, n = 10, 3
    cfg = tiny_config(rounds=rounds, train={"sync_every": 10})
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    state, log, port = tmp_path / "state", tmp_path / "coordinator.log", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(cfg_path, state, port, log)
    results: dict = {}
    errors: list = []
    threads = [threading.Thread(target=train, args=(url, i, n, results, errors)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while current_round(url) < 3:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = int((state / "run.db").exists())
        time.sleep(1.0)
        proc = start(cfg_path, state, port, log)
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        assert killed_at
        with CoordinatorClient(url, PTOKEN) as client:
            status = client.status()
            version, final = client.download()
            events = [e["message"] for e in client._json("GET", "/v1/events")["events"]]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status["finished"] and version == rounds
    committed = sorted(r["round"] for r in status["recent_rounds"])
    assert committed == list(range(rounds)), committed  # no committed round lost or repeated
    assert any(m.startswith("resumed at round") for m in events), events
    for i in range(n):
        for name, t in final.items():
            assert torch.equal(results[i][name], t), (i, name)
