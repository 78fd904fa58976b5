"""The run's figures survive a coordinator restart on the same state dir: the bytes in and
out (the sums of the per-participant counters, in the status, `fedtrain status` and
/metrics), and a run whose config came to ask for fewer rounds than it had committed
reads as finished at the rounds it committed, never as past its end."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import read_tensors
from tests.helpers.api import client, put, zeros_like_model
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator


def commit_rounds(c: BackgroundCoordinator, http: httpx.Client, pid: str, n: int) -> None:
    """`pid` downloads the model, then uploads an update, for `n` rounds; each one commits."""
    for _ in range(n):
        r = c.service.version
        assert http.get("/v1/model", params={"participant_id": pid}).status_code == 200
        assert put(http, r, pid, zeros_like_model(c)).json()["accepted"] is True
        info = http.get(f"/v1/rounds/{r}", params={"wait": 20, "participant_id": pid}).json()
        assert info["current_round"] == r + 1, info


def metric(c: BackgroundCoordinator, name: str) -> float:
    text = httpx.get(f"{c.url}/metrics", headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def test_bytes_in_and_out_persist_across_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config(rounds=0)) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        http.post("/v1/participants/b/leave")
        commit_rounds(c, http, "a", 3)
        assert http.get("/v1/model", params={"participant_id": "b"}).status_code == 200  # nothing stored after it
        before = http.get("/v1/status").json()
    per = {p["id"]: (p["bytes_up"], p["bytes_down"]) for p in before["participants"]}
    assert before["bytes_in"] == sum(up for up, _ in per.values()) > 0
    assert before["bytes_out"] == sum(down for _, down in per.values()) > 0
    assert per["b"][0] == 0 and per["b"][1] > 0

    with BackgroundCoordinator(state) as c, client(c) as http:
        after = http.get("/v1/status").json()
        assert {p["id"]: (p["bytes_up"], p["bytes_down"]) for p in after["participants"]} == per
        assert (after["bytes_in"], after["bytes_out"]) == (before["bytes_in"], before["bytes_out"])
        assert metric(c, "fedtrain_bytes_received_total") == before["bytes_in"]
        assert metric(c, "fedtrain_bytes_sent_total") == before["bytes_out"]
        head = format_status(after).splitlines()[2]
        assert head.startswith("bytes in ") and not head.startswith("bytes in 0 B"), head
        http.post("/v1/join", json={"name": "a"})  # a new process of "a" (its key died with its old client)
        commit_rounds(c, http, "a", 1)  # and they go on counting from there
        later = http.get("/v1/status").json()
    assert later["bytes_in"] > before["bytes_in"] and later["bytes_out"] > before["bytes_out"]
    assert later["bytes_in"] == sum(p["bytes_up"] for p in later["participants"])


def test_a_coordinator_process_stopped_with_sigterm_and_started_again_keeps_the_totals(tmp_path: Path) -> None:
    cfg_path, state, log, port = tmp_path / "run.json", tmp_path / "state", tmp_path / "coordinator.log", free_port()
    cfg_path.write_text(tiny_config(rounds=0).model_dump_json())
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=30)
    proc = start_coordinator(cfg_path, state, port, log)
    try:
        http.post("/v1/join", json={"name": "a"})
        model = http.get("/v1/model", params={"participant_id": "a"}).content
        zeros = {n: torch.zeros_like(t) for n, t in read_tensors([model])}
        assert put(http, 0, "a", zeros).json()["accepted"] is True
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["current_round"] == 1
        assert http.get("/v1/model", params={"participant_id": "a"}).status_code == 200  # nothing stored after it
        before = http.get("/v1/status").json()
        stop_coordinator(proc)  # SIGTERM: the coordinator's clean stop
        proc = start_coordinator(cfg_path, state, port, log)
        after = http.get("/v1/status").json()
    finally:
        http.close()
        stop_coordinator(proc)
    assert before["bytes_in"] > 0 and before["bytes_out"] > len(model) > 0
    assert (after["bytes_in"], after["bytes_out"]) == (before["bytes_in"], before["bytes_out"])
    assert after["participants"][0]["bytes_down"] == before["bytes_out"]


def test_a_run_restarted_with_fewer_rounds_than_it_committed_is_finished_at_its_count(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config(rounds=0)) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        commit_rounds(c, http, "a", 3)
    with BackgroundCoordinator(state, tiny_config(rounds=2), apply_config=True) as c, client(c) as http:
        s = http.get("/v1/status").json()
        assert metric(c, "fedtrain_rounds_planned") == 3
    assert s["finished"] and s["current_round"] == 3 and len(s["recent_rounds"]) == 3
    assert (s["rounds"], s["rounds_configured"]) == (3, 2)
    assert "round 3/3 (finished past the config's 2 rounds)" in format_status(s).splitlines()[0]


def test_rounds_lowered_live_below_the_committed_count_finish_the_run_there(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=10)) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        commit_rounds(c, http, "a", 3)
        http.post("/v1/participants/a/leave")  # no one in the open round: the change is in force at once
        admin = {"Authorization": f"Bearer {ATOKEN}"}
        assert http.put("/v1/config", json={"changes": {"rounds": 2}}, headers=admin).json()["effective_round"] == 3
        s = http.get("/v1/status").json()
    assert s["finished"] and (s["current_round"], s["rounds"], s["rounds_configured"]) == (3, 3, 2)
    assert format_status(s).startswith("run 'test': round 3/3 (finished past the config's 2 rounds), ")


def test_a_run_that_ends_on_its_count_reads_plainly(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=2)) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        commit_rounds(c, http, "a", 2)
        s = http.get("/v1/status").json()
    assert s["finished"] and (s["current_round"], s["rounds"], s["rounds_configured"]) == (2, 2, 2)
    assert format_status(s).startswith("run 'test': round 2/2 (finished), ")
