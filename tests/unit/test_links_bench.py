"""The pure parts of the shaped-link benchmark (benchmarks/links.py): its arguments, the rates and
the shaper's bucket, how a round's figures come out of the participants' lines and the veth
samples, the cost of a fault against the clean rounds, and the tables with two checkouts side by
side. No namespaces here: the benchmark itself needs root and runs by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import link_net
import link_runs
import link_tables
import links

GBIT = 1e9


def test_defaults_and_quick() -> None:
    full = links.parse_args([])
    assert full.models == [25.0, 100.0] and full.participants == [1, 4] and full.rounds == 2
    assert full.rates == [100e6, 1e9] and full.faults == list(link_runs.DEFAULT_FAULTS)
    quick = links.parse_args(["--quick"])
    assert quick.models == [25.0] and quick.participants == [1] and quick.rounds == 1
    assert quick.faults == ["reset-up", "silent-2"]
    assert links.parse_args(["--faults", ""]).faults == []
    assert links.parse_args(["--rates", "400M"]).rates == [400e6]


@pytest.mark.parametrize("argv", [["--faults", "reset-sideways"], ["--rates", "fast"], ["--rates", "10G0"],
                                  ["--participants", "0"], ["--rounds", "0"], ["--parts", "everything"],
                                  ["--models", "-1"]])
def test_bad_arguments_are_refused_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        links.parse_args(argv)
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_rates_and_the_bucket() -> None:
    assert link_net.parse_rate("100M") == 100e6
    assert link_net.parse_rate("1gbit") == 1e9
    with pytest.raises(ValueError, match="out of range"):
        link_net.parse_rate("10k")
    assert link_net.tbf_burst(100e6) == 64 * 1024  # the floor
    assert link_net.tbf_burst(1e9) == 250_000  # 2 ms at 1 Gbit/s


def test_busy_span_ignores_a_trickle() -> None:
    # 10 ms samples: idle, 1 s of upload at the full rate, a heartbeat's trickle, idle
    samples, rx, t = [], 0, 0.0
    for step in range(200):
        t = step * 0.01
        if 10 <= step < 110:
            rx += int(GBIT / 8 * 0.01)
        elif step == 150:
            rx += 2000
        samples.append((t, rx, 0))
    start, end = link_net.busy_span(samples, 1, GBIT)
    assert start == pytest.approx(0.09) and end == pytest.approx(1.09)
    assert link_net.busy_span(samples, 2, GBIT) is None
    assert link_net.busy_seconds(samples, 2, GBIT) == 0.0


def _round(r: int, t0: float, seconds: float, mb: int, who: int = 0, up: int | None = None) -> list[dict]:
    moved = mb * 1_000_000
    return [{"event": "begin", "round": r, "t": t0, "who": who, "rx": 0, "tx": 0, "cpu": 1.0, "coord_cpu": 1.0},
            {"event": "end", "round": r, "t": t0 + seconds, "who": who, "rx": up if up is not None else moved,
             "tx": moved, "cpu": 1.5, "coord_cpu": 2.0, "step_s": seconds, "sync_s": seconds / 2,
             "bytes_up": moved, "bytes_down": moved}]


def test_a_round_is_its_bytes_over_its_window() -> None:
    events = _round(0, 100.0, 2.0, 100) + _round(1, 110.0, 1.6, 100) + [{"event": "begin", "round": 2, "t": 120.0}]
    rows = link_runs.per_round(events, [], GBIT, n=1)
    assert [r["round"] for r in rows] == [0, 1]  # round 2 never ended: left out
    assert rows[1]["fraction"] == pytest.approx(200e6 * 8 / (1.6 * GBIT))
    assert rows[1]["coord_cpu_per_gb"] == pytest.approx(1.0 / 0.2)
    assert rows[1]["part_cpu_per_gb"] == pytest.approx(0.5 / 0.2)
    summary = link_runs.summarize_clean({"rounds": rows, "measured": 1, "rate_bit": GBIT})
    assert summary["fraction"] == pytest.approx(1.0)  # the measured round only, not the warm-up


def test_a_round_waits_for_every_participant() -> None:
    events = _round(0, 100.0, 2.0, 100, who=0) + _round(0, 100.5, 3.0, 100, who=1)
    assert link_runs.per_round(events[:3], [], GBIT, n=2) == []  # p1 has not ended
    (row,) = link_runs.per_round(events, [], GBIT, n=2)
    assert row["seconds"] == pytest.approx(3.5) and row["moved"] == 400e6


def test_a_fault_costs_what_its_round_moved_beyond_the_clean_ones() -> None:
    rows = link_runs.per_round(_round(0, 0, 2.0, 100) + _round(1, 10, 5.0, 100, up=150_000_000)
                               + _round(2, 20, 1.8, 100), [], GBIT, n=1)
    result = {"rounds": rows, "fault": "reset-up", "model_bytes": 100_000_000, "fault_at": 0.52}
    s = link_runs.summarize_fault(result, warmup=1)
    assert s["resent"] == pytest.approx(0.5) and s["extra_s"] == pytest.approx(5.0 - 1.8)
    assert s["at"] == 0.52 and s["sync_s"] == pytest.approx(2.5)
    assert link_runs.summarize_fault({**result, "rounds": rows[:1]}, warmup=1)["resent"] is None


def _report() -> dict:
    def run(side: str, fraction: float, fault: str | None = None) -> dict:
        summary = ({"resent": 0.5, "extra_s": 3.0, "round_s": 4.0, "sync_s": 2.0, "at": 0.5, "clean_round_s": 1.0}
                   if fault else {"fraction": fraction, "round_s": 1.8, "up_wire_fraction": 0.95,
                                  "down_wire_fraction": 0.94})
        return {"side": side, "model_bytes": 100_000_000, "rate_bit": GBIT, "n": 1, "fault": fault,
                "rounds": [{}], "summary": summary}
    return {"sides": ["merged", "main"], "raw": [{"rate_bit": GBIT, "fraction": 0.96}],
            "sync": [run("merged", 0.93), run("main", 0.91)],
            "faults": [run("merged", 0, "reset-up"), {**run("main", 0, "reset-up"), "error": "cut", "rounds": []}],
            "relay": [{"rtt_ms": 50.0, "window": 4_194_304, "kind": "raw", "streams": 4, "fraction": 0.95}]}


def test_tables_put_the_checkouts_side_by_side() -> None:
    report = _report()
    sync = link_tables.sync_table(report)
    assert "| 100 MB | 1 Gbit/s | 1 | 0.96 | 0.93 (0.95 / 0.94) | 1.8 | 0.91 (0.95 / 0.94) | 1.8 |" in sync
    assert "merged: sync (up / down)" in sync and "main: round s" in sync
    faults = link_tables.fault_table(report)
    assert "| reset-up at 50% | 0.50 | +3.0 | 4.0 (2.0) | failed | failed | failed |" in faults
    assert "| 50 | 4 MB | raw TCP | 4 | – | 0.95 |" in link_tables.relay_table(report)
    assert link_tables.relay_table({**report, "relay": []}) == ""


def test_without_root_it_skips(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(links, "check_support", lambda: "needs root (network namespaces and tc)")
    assert links.main(["--quick"]) == 0
    assert capsys.readouterr().out.strip() == "links: skipped: needs root (network namespaces and tc)"


def test_tables_of_an_earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = {**_report(), "load_before": "1.00 1.00 1.00", "load_after": "2.00 2.00 2.00"}
    (tmp_path / "links.json").write_text(json.dumps(report))
    assert links.main(["--from-json", str(tmp_path / "links.json")]) == 0
    out = capsys.readouterr().out
    assert "load average before / after: 1.00 1.00 1.00 / 2.00 2.00 2.00" in out
    assert "| 100 MB | 1 Gbit/s | 1 | 0.96 | 0.93 (0.95 / 0.94) |" in out and "| reset-up at 50% |" in out


def test_with_several_participants_the_phases_are_not_split() -> None:
    report = _report()
    report["sync"] = [{**r, "n": 4} for r in report["sync"]]
    assert "| 100 MB | 1 Gbit/s | 4 | 0.96 | 0.93 | 1.8 | 0.91 | 1.8 |" in link_tables.sync_table(report)
