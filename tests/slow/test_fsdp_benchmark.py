"""The FSDP sync benchmark runs end to end on a small model and prints its two tables (the real
figures are in docs/benchmarks.md). Slow: three coordinators' worth of processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_sync.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_memory_and_time_rows() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "1e6", "--rounds", "1"],
                          capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    out = done.stdout
    rows = re.findall(r"^\| 1M \| (fsdp|single|ddp) \| (\d) \| ([\d.]+) \|((?: [\d.-]+ \|){7})$", out, re.M)
    assert sorted((role, rank) for role, rank, *_ in rows) == [("ddp", "0"), ("ddp", "1"), ("fsdp", "0"),
                                                               ("fsdp", "1"), ("single", "0")], out
    shard = {(role, rank): float(mb) for role, rank, mb, _ in rows}
    assert shard[("fsdp", "0")] + shard[("fsdp", "1")] == pytest.approx(shard[("single", "0")], abs=0.5), out
    num = r" ([\d.]+) \|"
    times = re.findall(r"^\| 1M \|" + num + r" ([\d.]+)/([\d.]+) \|" + num + r" ([\d.]+)/([\d.]+) \|" + num * 4 + "$",
                       out, re.M)
    assert len(times) == 1 and all(float(x) > 0 for x in times[0]), out
