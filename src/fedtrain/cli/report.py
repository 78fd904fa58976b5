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


def ranks_label(p: dict[str, Any]) -> str:
    """How a participant trains, from its status row: "1" (one process), "ddp×4", "fsdp×2";
    "?" where it did not say (or said something unreadable), "-" from a coordinator that does not tell."""
    if "parallel" not in p:
        return "-"
    parallel, world = p["parallel"], p.get("world_size")
    if parallel == "single":
        return "1"
    name = parallel or "?"
    return f"{name}×{world}" if world else name


def expected_pieces(p: dict[str, Any]) -> int | None:
    """The pieces an update of participant `p` comes in, where its status says: one per FSDP rank."""
    pieces = p.get("pieces") or {}
    world = p.get("world_size")
    if p.get("parallel") == "fsdp" and world and world >= pieces.get("received", 0):
        return int(world)
    return None


def pieces_label(p: dict[str, Any]) -> str:
    """The open round's update of `p` in pieces: "1/2 (50%)" while they come in, "2/2 complete"
    once whole; "" for a participant that sends its update whole (or has sent nothing yet)."""
    pieces = p.get("pieces")
    if not pieces:
        return ""
    received, expected = pieces["received"], expected_pieces(p)
    count = f"{received}/{expected}" if expected else str(received)
    return f"{count} complete" if pieces["complete"] else f"{count} ({pieces['covered']:.0%})"


def transfers_in_flight(participants: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(participant, transfer) for each transfer in flight: a row's `transfers` (both directions),
    or its `transfer` alone from a coordinator that shows only that."""
    out = []
    for p in participants:
        moving = p.get("transfers")
        if moving is None:
            moving = [p["transfer"]] if isinstance(p.get("transfer"), dict) else []
        out += [(str(p["id"]), t) for t in moving if isinstance(t, dict)]
    return out


def format_transfers(moving: list[tuple[str, dict[str, Any]]]) -> str:
    """The transfers in flight: who, which way, what, bytes of the total, rate, time left."""
    rows = []
    for pid, t in moving:
        total, done = t.get("total"), t.get("bytes", 0)
        of = f"{human_bytes(done)} of {human_bytes(total)} ({done / total:.0%})" if total else human_bytes(done)
        eta = t.get("eta_s")
        rows.append([pid, {"up": "↑ up", "down": "↓ down"}.get(t.get("direction", ""), "?"), t.get("what", ""), of,
                     f"{human_bytes(t.get('rate_bps') or 0)}/s", "-" if eta is None else f"{eta:.0f}s",
                     t.get("connections", 1)])
    return table(["participant", "way", "what", "bytes", "rate", "left", "conns"], rows)


def format_status(s: dict[str, Any]) -> str:
    now = time.time()
    rounds = f"{s['current_round']}/{s['rounds'] or '∞'}"
    finished = ""
    if s["finished"]:
        configured = s.get("rounds_configured", s["rounds"])
        finished = " (finished)" if configured == s["rounds"] else f" (finished past the config's {configured} rounds)"
    streaming = s.get("streaming")  # Streaming DiLoCo: the open round syncs one fragment of K
    if streaming and s.get("fragment") is not None and not s["finished"]:
        rounds += f" (fragment {s['fragment']} of {streaming['k']})"
    head = (
        f"run {s['run']!r}: round {rounds}{finished}, "
        f"{s['algorithm']}" + (f" (outer lr {s['outer_lr']:g})" if s.get("outer_lr") is not None else "")
        + f", {s.get('mode', 'rounds')} mode"
        + (f" (streaming: K={streaming['k']}, τ={streaming['overlap']}, α={streaming['alpha']:g})" if streaming else "")
        + f", {s['parameters']:,} parameters "
        f"({human_bytes(s['model_bytes'])}), "
        f"config v{s['config_version']}\n"
        f"round state: {s['reason']}\n"
        f"bytes in {human_bytes(s['bytes_in'])}, out {human_bytes(s['bytes_out'])}\n"
    )
    in_pieces = any(p.get("pieces") for p in s["participants"])  # the column only while there is one
    parts = [
        head,
        table(
            ["participant", "state", "ranks", "round", "step", "H", "tokens", "tok/s", "loss", "last seen", "up",
             "down", "stale", "share"] + (["pieces (this round)"] if in_pieces else []),
            [
                [
                    p["id"],
                    p["state"],
                    ranks_label(p),
                    p["round"],
                    p["step"],
                    _fmt(p.get("sync_every"), "d"),
                    f"{p['tokens']:,}",
                    _fmt(p["tokens_per_s"], ".0f"),
                    _fmt(p["loss"]),
                    f"{now - p['last_seen']:.0f}s ago",
                    human_bytes(p["bytes_up"]),
                    human_bytes(p["bytes_down"]),
                    "-" if p.get("staleness") is None else p["staleness"],
                    "-" if p.get("share") is None else f"{p['share']:.0%} ({p.get('applied', 0)})",
                ]
                + ([pieces_label(p)] if in_pieces else [])
                for p in s["participants"]
            ],
        ),
    ]
    moving = transfers_in_flight(s["participants"])
    if moving:
        parts.append("\ntransfers in flight:\n" + format_transfers(moving))
    if s.get("schedule_mode") == "balanced":  # each participant's own H, and why
        told = [f"  {p.get('sync_every_reason') or p['id']}" for p in s["participants"] if p["state"] == "active"]
        parts.append(f"\nbalanced rounds, H for round {s['current_round']}:\n" + "\n".join(told or ["  (none active)"]))
    if s.get("recent_rounds"):
        fragments = any(r.get("fragment") is not None for r in s["recent_rounds"])  # the column only when streaming
        parts.append(
            "\n"
            + table(
                ["round"] + (["fragment"] if fragments else [])
                + ["updates", "tokens", "bytes up", "fp32 / up", "bytes down", "fp32 / down", "duration", "merge",
                   "closed because"],
                [
                    [r["round"]] + ([_fmt(r.get("fragment"), "d")] if fragments else []) + [
                        r["n_submissions"],
                        f"{r['tokens']:,}",
                        human_bytes(r.get("bytes_in", 0)),
                        f"{r['vs_fp32_in']:g}x" if r.get("vs_fp32_in") else "-",
                        human_bytes(r["bytes_out"]) if r.get("bytes_out") is not None else "-",
                        f"{r['vs_fp32_out']:g}x" if r.get("vs_fp32_out") else "-",
                        f"{r['closed_at'] - r['opened_at']:.1f}s",
                        f"{r['merge_s']:.2f}s",
                        r["close_reason"],
                    ]
                    for r in s["recent_rounds"][:10]
                ],
            )
        )
    if s.get("evals"):
        parts.append("\nevals around each sync (held-out loss):\n" + format_evals(s["evals"][-40:]))
    privacy = privacy_lines(s.get("privacy")) + secagg_line(s.get("secure_aggregation"))
    if privacy:
        parts.append(privacy)
    return "\n".join(parts)


def privacy_lines(p: dict[str, Any] | None) -> str:
    """Central DP's line of `fedtrain status`: (ε, δ) spent after the committed rounds, against the
    budget ("" when the run has no DP)."""
    if not p:
        return ""
    budget = "no budget" if p.get("budget") is None else f"budget ε {p['budget']:g}"
    over = " OVER BUDGET" if p.get("over_budget") else ""
    mechanism = p.get("mechanism", "central")
    return (f"\nprivacy: {mechanism} DP, (ε, δ) = ({p['epsilon']:.4g}, {p['delta']:g}) after {p['rounds']} rounds "
            f"({budget}{over}); σ {p['noise_multiplier']:g}, C {p['clip_norm']:g}, {p['accountant']}")


def secagg_line(a: dict[str, Any] | None) -> str:
    """Secure aggregation's line of `fedtrain status`: the open round's phase and how far it got
    ("" when the run does not use it)."""
    if not a:
        return ""
    ring = f", 2^{a['ring_bits']} ring" if a.get("ring_bits") else ""
    refused = a.get("refused_attempts") or 0
    return (f"\nsecure aggregation: round {a['round']}, phase {a['phase']} ({a['uploaded']} of {a['sharing']} "
            f"sharing uploaded, {a['participants']} advertised, t = {a['threshold']}{ring}); "
            f"{refused} attempt{'s' if refused != 1 else ''} refused"
            + (f"\n  {a['reason']}" if a.get("reason") else ""))


GLOBAL_EVAL = "global_eval/"
"""Prefix of the coordinator's own evaluation of global version v (stored with round = v)."""


def eval_rows(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (round, participant): the eval before the sync (local model), after it (new global
    model), tokens; plus the coordinator's eval of the global model that the round produced.

    `metrics` are rows of `GET /v1/metrics`. Rounds without evals (eval.every > 1) are left out."""
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    global_by_version: dict[int, dict[str, float]] = {}
    for m in metrics:
        name, r, pid = m["name"], m.get("round"), m.get("participant_id")
        if r is None:
            continue
        if pid is None and name.startswith(GLOBAL_EVAL):
            global_by_version.setdefault(int(r), {})[name[len(GLOBAL_EVAL) :]] = m["value"]
            continue
        if pid is None:
            continue
        row = rows.setdefault((int(r), pid), {"round": int(r), "participant": pid, "before": {}, "after": {}})
        if name.startswith("eval_before/"):
            row["before"][name[len("eval_before/") :]] = m["value"]
        elif name.startswith("eval_after/"):
            row["after"][name[len("eval_after/") :]] = m["value"]
        elif name in ("tokens", "train_loss", "bytes_up", "bytes_down"):
            row[name] = m["value"]
    out = [row for _, row in sorted(rows.items()) if row["before"] or row["after"]]
    for row in out:
        row["global_after"] = global_by_version.get(row["round"] + 1, {})
    if 0 in global_by_version:
        initial = {"round": -1, "participant": "(initial)", "before": {}, "after": {}}
        out.insert(0, {**initial, "global_after": global_by_version[0]})
    return out


def format_evals(rows: list[dict[str, Any]]) -> str:
    """The eval table: round, participant, tokens, loss before and after the sync, global loss."""
    lines = []
    last_round = None
    for row in rows:
        first = row["round"] != last_round
        last_round = row["round"]
        lines.append(
            [
                ("init" if row["round"] < 0 else row["round"]) if first else "",
                row["participant"],
                f"{int(row['tokens']):,}" if "tokens" in row else "",
                _fmt(row.get("train_loss")) if "train_loss" in row else "",
                _fmt(row["before"].get("loss")),
                _fmt(row["after"].get("loss")),
                _fmt(row["global_after"].get("loss")) if first and row["global_after"] else "",
            ]
        )
    return table(["round", "participant", "tokens", "train", "before sync", "after sync", "global (coord.)"], lines)
