"""The markdown tables of benchmarks/links.py, from its report (plain data in, text out): the link
used per sync, the cost of faults, and the relay's figures; one column group per checkout."""

from __future__ import annotations

from typing import Any


def _f(v: Any, spec: str = ".2f", missing: str = "–") -> str:
    return missing if v is None else format(v, spec)


def _rate(bit: float) -> str:
    return f"{bit / 1e9:g} Gbit/s" if bit >= 1e9 else f"{bit / 1e6:g} Mbit/s"


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _cell(r: dict[str, Any] | None, fmt: Any) -> str:
    if r is None:
        return "–"
    if "error" in r and not r.get("rounds"):
        return "failed"
    return fmt(r["summary"]) + (" (!)" if "error" in r else "")


def _by_side(runs: list[dict[str, Any]], sides: list[str], key: Any) -> dict[Any, dict[str, dict[str, Any]]]:
    out: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(key(r), {})[r["side"]] = r
    return {k: {s: v[s] for s in sides if s in v} for k, v in out.items()}


def sync_table(report: dict[str, Any]) -> str:
    """Fraction of the link per sync: (up + down bytes) / (round s x rate), and for N = 1 the upload
    and the download alone (wire bytes / the seconds bytes moved); raw TCP of the same link beside it."""
    sides = report["sides"]
    if not report["sync"]:
        return ""
    raw = {r["rate_bit"]: r["fraction"] for r in report["raw"]}
    head = "| model | link | N | raw TCP | " + " | ".join(f"{s}: sync (up / down) | {s}: round s" for s in sides) + " |"
    rule = "|" + "---|" * (4 + 2 * len(sides))
    lines = ["Fraction of the link used per sync", "", head, rule]
    groups = _by_side(report["sync"], sides, lambda r: (r["model_bytes"], r["rate_bit"], r["n"]))
    for (size, rate, n), by in groups.items():
        cells = []
        for s in sides:
            r = by.get(s)
            if n == 1:
                cells.append(_cell(r, lambda m: f"{_f(m['fraction'])} ({_f(m.get('up_wire_fraction'))} / "
                                                f"{_f(m.get('down_wire_fraction'))})"))
            else:  # one participant's upload overlaps another's download: no phases to time apart
                cells.append(_cell(r, lambda m: _f(m["fraction"])))
            cells.append(_cell(r, lambda m: _f(m.get("round_s"), ".1f")))
        lines.append(f"| {_mb(size)} | {_rate(rate)} | {n} | {_f(raw.get(rate))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fault_table(report: dict[str, Any]) -> str:
    """Per fault: bytes sent again / update bytes, extra round seconds, the round's real seconds and
    what `fed.history` says it took (sync_s)."""
    sides = report["sides"]
    if not report["faults"]:
        return ""
    first = report["faults"][0]
    head = "| fault | " + " | ".join(f"{s}: re-sent × update | {s}: extra s | {s}: round s (history)"
                                    for s in sides) + " |"
    rule = "|" + "---|" * (1 + 3 * len(sides))
    lines = [f"Faults ({_mb(first['model_bytes'])} model, {_rate(first['rate_bit'])}, N = 1; clean round "
             f"{_f(first['summary'].get('clean_round_s'), '.1f')} s)", "", head, rule]
    for fault, by in _by_side(report["faults"], sides, lambda r: r["fault"]).items():
        cells = []
        for s in sides:
            r = by.get(s)
            cells.append(_cell(r, lambda m: _f(m.get("resent"))))
            cells.append(_cell(r, lambda m: _f(m.get("extra_s"), "+.1f")))
            cells.append(_cell(r, lambda m: f"{_f(m.get('round_s'), '.1f')} ({_f(m.get('sync_s'), '.1f')})"))
        at = next((r["summary"].get("at") for r in by.values() if r["summary"].get("at") is not None), None)
        lines.append(f"| {fault}{f' at {at:.0%}' if at is not None else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def relay_table(report: dict[str, Any]) -> str:
    """Through the latency relay: raw TCP with 1 or more streams, and syncs with transfer.streams."""
    rows = report["relay"]
    if not rows:
        return ""
    lines = ["Through the latency relay", "", "| RTT ms | window | what | streams | checkout | fraction |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") == "raw":
            lines.append(f"| {r['rtt_ms']:g} | {_mb(r['window'])} | raw TCP | {r['streams']} | – | "
                         f"{_f(r['fraction'])} |")
        else:
            lines.append(f"| {r['rtt_ms']:g} | {_mb(r['window'])} | sync {_mb(r['model_bytes'])} | {r['streams']} | "
                         f"{r['side']} | {_cell(r, lambda m: _f(m['fraction']))} |")
    return "\n".join(lines)
