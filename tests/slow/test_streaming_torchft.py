"""Streaming DiLoCo against torchft 0.2.0 itself: `benchmarks/streaming_compare.py --quick` runs
torchft's `DiLoCo` with fragments (two replica threads, gloo on loopback) and
`fedtrain.streaming.simulate` on the same seeded problem, and every row must agree to 1e-5.

Slow, and skipped where torchft's venv is missing (`python benchmarks/torchft_compare.py
--setup` makes it; TORCHFT_VENV points at another one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "streaming_compare.py"
VENV = Path(os.environ.get("TORCHFT_VENV") or ROOT / ".benchmarks" / "torchft-venv")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streaming_diloco_matches_torchft() -> None:
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no torchft venv at {VENV} (python benchmarks/torchft_compare.py --setup)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--venv", str(VENV)], capture_output=True,
                          text=True, timeout=540, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = re.findall(r"^\s*(\d) +(\d) +([\d.]+) +\w+ +(\d) +\w+ +(\d+) +(\S+) +(\S+) +(\S+) +(\S+) +(yes|NO)$",
                      done.stdout, re.M)
    assert len(rows) == 3 and all(r[-1] == "yes" for r in rows), done.stdout
    assert {(k, tau) for k, tau, *_ in rows} == {("1", "0"), ("2", "1"), ("4", "2")}, done.stdout
    assert all(float(r[-2]) <= 1e-5 for r in rows), done.stdout  # the real coordinator and participants too
