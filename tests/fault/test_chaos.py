"""The bounded chaos run (benchmarks/chaos.py): the quick run passes all its checks (slow:
minutes), and a run that cannot finish in its time limit says how far it got and exits
non-zero, never with a traceback (fast: a tiny time limit)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAOS = str(ROOT / "benchmarks" / "chaos.py")


@pytest.mark.timeout(240)
def test_a_run_out_of_time_reports_the_round_reached(tmp_path: Path) -> None:
    # 200 rounds cannot be done in 15 s; every coordinator restart is armed at a fault point,
    # so the time limit usually finds the coordinator armed or just dead at its point.
    out = tmp_path / "chaos.json"
    argv = ["--quick", "--rounds", "200", "--sync-every", "4", "--participants", "2", "--seed", "1"]
    argv += ["--time-limit", "15", "--kill-every", "2", "3", "--coordinator-share", "0.5", "--armed-share", "1"]
    r = subprocess.run(
        [sys.executable, CHAOS, *argv, "--json", str(out), "--dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=220,
    )
    output = r.stdout[-4000:] + r.stderr[-4000:]
    assert "Traceback" not in r.stdout + r.stderr, output
    assert r.returncode == 1, output
    said = re.search(r"^chaos run: out of time at round (\d+)/200 \(time limit of 15 s reached\)$", r.stdout, re.M)
    assert said, output
    report = json.loads(out.read_text())
    assert report["outcome"] == f"out of time at round {said[1]}/200"
    assert report["rounds_done"] == int(said[1])
    assert not report["passed"] and not report["checks"]["run finished"]
    # A coordinator without faults was there for the final calls, whatever state the run left it in.
    assert report["problems"]["final_checks"] == [], output
    assert report["final_loss"] is not None
    assert "NOT PASSED" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_chaos_run(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    r = subprocess.run(
        [sys.executable, CHAOS, "--quick", "--seed", "1", "--json", str(out), "--dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["outcome"] == "finished"
    assert report["passed"] and all(report["checks"].values())
    assert report["kills_survived"] >= 5 and report["kills"]["coordinator"] >= 1
    assert report["final_loss"] < report["initial_loss"]
