"""`fedtrain demo` end to end: separate processes over loopback, a summary with falling loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_short_demo_writes_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedtrain",
            "demo",
            "--participants",
            "2",
            "--rounds",
            "3",
            "--sync-every",
            "10",
            "--summary",
            str(summary),
            "--state-dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["participants"] == 2 and s["rounds"] == 3
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, s
    assert [p["id"] for p in s["per_participant"]] == ["p0", "p1"]
    assert abs(sum(p["weight"] for p in s["per_participant"]) - 1.0) < 1e-3
    assert s["bytes_up"] > 0 and s["bytes_down"] > 0 and s["dp_equivalent_bytes"] > s["bytes_up"]
    assert "global eval loss (held-out)" in r.stdout and "round 3/3" in r.stdout
    # before/after evals per round and participant, and the coordinator's own eval of each global model
    assert [(e["round"], e["participant"]) for e in s["evals"]] == [(-1, "(initial)")] + [
        (r_, p) for r_ in range(3) for p in ("p0", "p1")
    ]
    assert all(e["before"]["loss"] > 0 and e["after"]["loss"] > 0 for e in s["evals"][1:])
    assert s["evals"][0]["global_after"]["loss"] == pytest.approx(s["initial_eval_loss"], abs=1e-3)
    assert s["evals"][-1]["global_after"]["loss"] == pytest.approx(s["final_eval_loss"], abs=1e-3)
    assert s["bytes_per_round"]["upload_per_participant"] >= s["bytes_per_round"]["sync_set_bytes"]
    assert "evals around each sync" in r.stdout and "before sync" in r.stdout


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    import os
    import signal
    import time

    state = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--rounds", "50", "--state-dir", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


def test_demo_removes_its_temp_dir_unless_kept(tmp_path: Path) -> None:
    """Without --state-dir the demo's state goes to a temp dir, removed once the run finished;
    --keep keeps it (and a failed run keeps it too, tested through the same flag's absence)."""
    import os

    argv = [sys.executable, "-m", "fedtrain", "demo", "--participants", "1", "--rounds", "1", "--sync-every", "2"]
    removed, keep = tmp_path / "removed", tmp_path / "keep"  # the two runs at once, each its own TMPDIR
    runs = {}
    for tmp, extra in ((removed, []), (keep, ["--keep"])):
        tmp.mkdir()
        runs[tmp] = subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "TMPDIR": str(tmp)})
    out = {tmp: proc.communicate(timeout=300) for tmp, proc in runs.items()}
    assert runs[removed].returncode == 0, out[removed]
    assert "removed at the end unless --keep" in out[removed][0] and "state and logs: removed" in out[removed][0]
    assert not list(removed.glob("fedtrain-demo-*")), "the demo left its temp dir behind"
    assert runs[keep].returncode == 0, out[keep]
    kept = list(keep.glob("fedtrain-demo-*"))
    assert len(kept) == 1 and (kept[0] / "state" / "run.db").is_file()
    assert f"state and logs: {kept[0] / 'state'}" in out[keep][0]


def test_a_streaming_demo_syncs_a_fragment_per_round(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--streaming", "2", "--rounds", "4",
            "--sync-every", "10", "--summary", str(summary), "--state-dir", str(tmp_path / "demo")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["streaming"]["fragments"] == 2 and s["rounds"] == 4
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3, s
    per_round = s["bytes_per_round"]
    assert per_round["upload_per_participant"] < 0.75 * per_round["sync_set_bytes"]  # one fragment, not the model
    assert "Streaming DiLoCo: 2 fragments, one synced every 5 inner steps" in r.stdout
    assert "rounds of H/K=5 (Streaming DiLoCo, K=2 fragments)" in r.stdout

    bad = subprocess.run([*argv[:7], "3", "--rounds", "2", "--sync-every", "10"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "must be a multiple of streaming.fragments (K=3)" in bad.stderr
    assert "Traceback" not in bad.stderr
