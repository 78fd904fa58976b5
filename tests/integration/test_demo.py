"""`fedtrain demo` end to end: separate processes over loopback, a summary with falling loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import zygote


def test_short_demo_writes_summary_and_removes_its_temp_dir(tmp_path: Path) -> None:
    """Without --state-dir the demo's state goes to a temp dir, removed once the run finished
    (the streaming demo below keeps it with --keep)."""
    summary, tmp = tmp_path / "summary.json", tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--rounds", "3", "--sync-every", "10",
            "--summary", str(summary)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["participants"] == 2 and s["rounds"] == 3
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, s
    assert [p["id"] for p in s["per_participant"]] == ["p0", "p1"]
    assert abs(sum(p["weight"] for p in s["per_participant"]) - 1.0) < 1e-3
    assert s["bytes_up"] > 0 and s["bytes_down"] > 0 and s["dp_equivalent_bytes"] > s["bytes_up"]
    assert "global eval loss (held-out)" in r.stdout and "round 3/3" in r.stdout
    # the first seconds say what happens, phase by phase, before the first progress line
    phases = ["starting the coordinator", "evaluating the initial global model", "starting 2 participants"]
    where = [next((i for i, line in enumerate(r.stdout.splitlines()) if p in line), -1) for p in phases]
    first_round = next(i for i, line in enumerate(r.stdout.splitlines()) if "round 0/3" in line)
    assert -1 not in where and where == sorted(where) and where[-1] < first_round, r.stdout
    # before/after evals per round and participant, and the coordinator's own eval of each global model
    assert [(e["round"], e["participant"]) for e in s["evals"]] == [(-1, "(initial)")] + [
        (r_, p) for r_ in range(3) for p in ("p0", "p1")
    ]
    assert all(e["before"]["loss"] > 0 and e["after"]["loss"] > 0 for e in s["evals"][1:])
    assert s["evals"][0]["global_after"]["loss"] == pytest.approx(s["initial_eval_loss"], abs=1e-3)
    assert s["evals"][-1]["global_after"]["loss"] == pytest.approx(s["final_eval_loss"], abs=1e-3)
    # the recommended compression both ways (int2: 2 bits a value and a scale per 256, 15x fewer bytes)
    assert s["bytes_per_round"]["upload_per_participant"] < s["bytes_per_round"]["sync_set_bytes"] / 10
    assert "evals around each sync" in r.stdout and "before sync" in r.stdout
    assert "removed at the end unless --keep" in r.stdout and "state and logs: removed" in r.stdout
    assert not list(tmp.glob("fedtrain-demo-*")), "the demo left its temp dir behind"


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """(Forked from the test template, the demo's processes too: `zygote.popen(nested=True)`.)"""
    import signal
    import time

    state = tmp_path / "demo"
    proc = zygote.popen(
        [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--rounds", "50", "--state-dir", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        nested=True,
    )
    deadline = time.monotonic() + 120
    while not (state / "logs" / "p1.log").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "stopped" in err
    pid = int(__import__("json").loads((state / "state" / "endpoint.json").read_text())["pid"])
    time.sleep(0.5)
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the coordinator survived Ctrl+C of the demo"


def test_a_streaming_demo_syncs_a_fragment_per_round(tmp_path: Path) -> None:
    """`fedtrain demo --streaming 2 --rounds 2` (H=40: a round every 20 steps), as a user first runs
    it, with 2 participants (the demo's 4 cost the default run 2x the time and check nothing more
    here); --keep keeps the demo's temp dir (state and logs) after the run. The demo and its
    processes are forked from the test template (`nested`): the short demo above starts cold."""
    summary, tmp = tmp_path / "summary.json", tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--streaming", "2", "--rounds", "2",
            "--summary", str(summary), "--keep"]
    r = zygote.run(argv, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)}, nested=True)
    assert r.returncode == 0, r.stdout + r.stderr
    [kept] = tmp.glob("fedtrain-demo-*")
    assert (kept / "state" / "run.db").is_file() and f"state and logs: {kept / 'state'}" in r.stdout
    s = json.loads(summary.read_text())
    assert s["streaming"]["fragments"] == 2 and s["rounds"] == 2
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3, s
    per_round = s["bytes_per_round"]
    assert per_round["upload_per_participant"] < 0.75 * per_round["sync_set_bytes"]  # one fragment, not the model
    assert "Streaming DiLoCo: 2 fragments, one synced every 20 inner steps" in r.stdout
    assert "rounds of H/K=20 (Streaming DiLoCo, K=2 fragments)" in r.stdout
    progress = [line for line in r.stdout.splitlines() if line.startswith("[") and "tok/s" in line]
    assert any(" H/K=20" in line for line in progress) and not any(" H=" in line for line in progress), progress
    # No eval around a sync is worse than the untrained model's. Without warmup, p3's eval before
    # the first sync read 6.42 against 5.31 untrained: AdamW's first ~20 steps from scratch spike the
    # loss for a step now and then, and one spike fell on step 20 (train.warmup_steps in the demo).
    worst = max(e[k]["loss"] for e in s["evals"][1:] for k in ("before", "after"))
    assert worst < s["initial_eval_loss"], s["evals"]

    bad = zygote.run([*argv[:7], "3", "--rounds", "2", "--sync-every", "10"], text=True, timeout=60)
    assert bad.returncode == 2 and "must be a multiple of streaming.fragments (K=3)" in bad.stderr
    assert "Traceback" not in bad.stderr
