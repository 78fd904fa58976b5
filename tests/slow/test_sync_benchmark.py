"""The sync benchmark's throughput and memory modes run end to end on a small model and print
sane figures (the real figures are in docs/benchmarks.md). Slow: coordinator processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sync_throughput.py"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_throughput_rows_for_both_modes() -> None:
    out = run("--params", "2e6", "--participants", "1,2", "--rounds", "2", "--warmup", "1")
    rows = re.findall(r"^\s+(\d+) (commit|publish_first)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", out, re.M)
    assert {(n, mode) for n, mode, *_ in rows} == {("1", "commit"), ("1", "publish_first"),
                                                   ("2", "commit"), ("2", "publish_first")}, out
    for *_, best, median, _mbs, raw, ratio in rows:
        assert 0 < float(best) <= float(median) and 0 < float(ratio) < 1.5 and int(raw) > 0, out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_memory_rows() -> None:
    out = run("--memory", "--params", "25e6", "--participants", "1,2")
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)$", out, re.M)
    assert [n for n, *_ in rows] == ["1", "2"], out
    for _, _, ratio in rows:
        assert 3.0 < float(ratio) < 8.0, out  # master + momentum + sum, plus the interpreter
