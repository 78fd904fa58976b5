"""`fedtrain demo` end to end: separate processes over loopback, a summary with falling loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_short_demo_writes_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, "-m", "fedtrain", "demo", "--participants", "2", "--rounds", "3", "--sync-every", "10",
         "--summary", str(summary), "--state-dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["participants"] == 2 and s["rounds"] == 3
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, s
    assert [p["id"] for p in s["per_participant"]] == ["p0", "p1"]
    assert abs(sum(p["weight"] for p in s["per_participant"]) - 1.0) < 1e-3
    assert s["bytes_up"] > 0 and s["bytes_down"] > 0 and s["dp_equivalent_bytes"] > s["bytes_up"]
    assert "global eval loss (held-out)" in r.stdout and "round 3/3" in r.stdout
