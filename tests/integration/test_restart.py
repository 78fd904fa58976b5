"""A coordinator killed with SIGKILL mid-run and started again resumes with no committed round
lost; its participants reconnect by themselves and finish on identical weights."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import torch

from fedtrain.participant import CoordinatorClient
from tests.helpers.config import BOTH_TRANSPORTS, PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator
from tests.helpers.runs import recipe_gpt
from tests.helpers.tiny import TinyParticipant, join_all

pytestmark = BOTH_TRANSPORTS


def current_round(url: str) -> int:
    return httpx.get(f"{url}/v1/healthz", timeout=5).json()["current_round"]


def test_sigkill_coordinator_resumes_without_losing_rounds(tmp_path: Path) -> None:
    rounds, n = 10, 3
    cfg = tiny_config(rounds=rounds, train={"sync_every": 10})
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    state, log, port = tmp_path / "state", tmp_path / "coordinator.log", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_coordinator(cfg_path, state, port, log)
    runners = [TinyParticipant(url, f"p{i}", recipe_gpt(i, n)) for i in range(n)]
    try:
        for r in runners:
            r.start()
        deadline = time.monotonic() + 120
        while current_round(url) < 3:
            assert time.monotonic() < deadline and not any(r.error for r in runners), [r.error for r in runners]
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = int((state / "run.db").exists())
        time.sleep(1.0)
        proc = start_coordinator(cfg_path, state, port, log)
        join_all(*runners)
        assert killed_at
        with CoordinatorClient(url, PTOKEN) as client:
            status = client.status()
            version, final = client.download()
            events = [e["message"] for e in client.recent_events()]
    finally:
        stop_coordinator(proc)
    assert status["finished"] and version == rounds
    committed = sorted(r["round"] for r in status["recent_rounds"])
    assert committed == list(range(rounds)), committed  # no committed round lost or repeated
    assert any(m.startswith("resumed at round") for m in events), events
    for i, r in enumerate(runners):
        for name, t in final.items():
            assert torch.equal(r.weights[name], t), (i, name)
