"""The bounded chaos run (benchmarks/chaos.py --quick) passes all its checks. Slow: minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_chaos_run(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "chaos.py"),
            "--quick",
            "--seed",
            "1",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and all(report["checks"].values())
    assert report["kills_survived"] >= 5 and report["kills"]["coordinator"] >= 1
    assert report["final_loss"] < report["initial_loss"]
