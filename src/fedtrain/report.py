"""Plain-text views of a run for terminals: `fedtrain status` and the demo's summary table."""

from __future__ import annotations

import time
from typing import Any


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_status(s: dict[str, Any]) -> str:
    now = time.time()
    rounds = f"{s['current_round']}/{s['rounds'] or '∞'}"
    head = (
        f"run {s['run']!r}: round {rounds}{' (finished)' if s['finished'] else ''}, "
        f"{s['algorithm']}, {s['parameters']:,} parameters ({human_bytes(s['model_bytes'])}), "
        f"config v{s['config_version']}\n"
        f"round state: {s['reason']}\n"
        f"bytes in {human_bytes(s['bytes_in'])}, out {human_bytes(s['bytes_out'])}\n"
    )
    parts = [
        head,
        table(
            ["participant", "state", "round", "step", "tokens", "tok/s", "loss", "last seen", "up", "down"],
            [
                [
                    p["id"],
                    p["state"],
                    p["round"],
                    p["step"],
                    f"{p['tokens']:,}",
                    _fmt(p["tokens_per_s"], ".0f"),
                    _fmt(p["loss"]),
                    f"{now - p['last_seen']:.0f}s ago",
                    human_bytes(p["bytes_up"]),
                    human_bytes(p["bytes_down"]),
                ]
                for p in s["participants"]
            ],
        ),
    ]
    if s.get("recent_rounds"):
        parts.append(
            "\n"
            + table(
                ["round", "updates", "tokens", "duration", "merge", "closed because"],
                [
                    [
                        r["round"],
                        r["n_submissions"],
                        f"{r['tokens']:,}",
                        f"{r['closed_at'] - r['opened_at']:.1f}s",
                        f"{r['merge_s']:.2f}s",
                        r["close_reason"],
                    ]
                    for r in s["recent_rounds"][:10]
                ],
            )
        )
    return "\n".join(parts)
