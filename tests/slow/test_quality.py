"""The learning-quality benchmark's --quick mode end to end: table and plot written, numbers sane."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _rows(markdown: str) -> dict[str, dict[str, float]]:
    rows = {}
    for line in markdown.splitlines():
        m = re.match(r"\| `([\w.-]+)` \| [^|]+ \| ([\d.]+) \| [^|]+ \| ([\d.]+) M \| ([\d.]+) (\w+) \|", line)
        if m:
            name, loss, tokens, size, unit = m.groups()
            rows[name] = {"loss": float(loss), "tokens": float(tokens), "bytes": float(size) * UNITS[unit]}
    return rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quality_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    png = tmp_path / "quality.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = _rows((tmp_path / "quality.md").read_text())
    assert {"dp", "diloco-h10", "diloco-h100", "fedavg-h100", "diloco-h50-iid", "diloco-h50-int8-ef"} <= set(rows)
    assert any(name.startswith("fedadam") for name in rows)
    # Every method saw the same tokens (but the lone participant: a quarter) and learned; the untrained
    # loss is about ln(256) = 5.5.
    assert len({row["tokens"] for name, row in rows.items() if name != "solo"}) == 1
    assert rows["solo"]["tokens"] == pytest.approx(rows["dp"]["tokens"] / 4, rel=0.05)
    for name, row in rows.items():
        assert math.isfinite(row["loss"]) and 1.0 < row["loss"] < 4.5, (name, row)
    # Bytes: DP all-reduces every step; fewer rounds send less; int8 uploads are ~4x smaller.
    assert rows["dp"]["bytes"] > 5 * rows["diloco-h10"]["bytes"]
    assert rows["diloco-h10"]["bytes"] > rows["diloco-h50"]["bytes"] > rows["diloco-h100"]["bytes"]
    assert rows["dp"]["bytes"] / rows["diloco-h100"]["bytes"] >= 50
    assert rows["diloco-h50-int8"]["bytes"] < 0.7 * rows["diloco-h50"]["bytes"]
