"""Pure decisions of the coordinator: when a round closes, who has gone silent.

Every rule is a function of (state, now, config) that returns its decision together with
a reason in words; the reason is logged and shown to users. Nothing here reads a clock,
a socket or a file, so each rule is tested by passing the time in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fedtrain.config import RunConfig

ACTIVE = "active"
FAILED = "failed"
LEFT = "left"
EVICTED = "evicted"


@dataclass(frozen=True)
class ParticipantView:
    id: str
    state: str
    last_seen: float


@dataclass(frozen=True)
class RoundView:
    round: int
    opened_at: float
    submitted: frozenset[str]


@dataclass(frozen=True)
class Decision:
    action: Literal["wait", "close"]
    reason: str


def _names(ids: Sequence[str] | set[str], limit: int = 5) -> str:
    ids = sorted(ids)
    shown = ", ".join(ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def decide_round(rnd: RoundView, participants: Sequence[ParticipantView], now: float, cfg: RunConfig) -> Decision:
    """Close the round when every active participant has submitted (and the quorum is met),
    or when the deadline has passed with at least `min_participants` submissions."""
    active = {p.id for p in participants if p.state == ACTIVE}
    n = len(rnd.submitted)
    quorum = cfg.min_participants
    if n == 0:
        return Decision("wait", f"round {rnd.round}: no submissions yet ({len(active)} active)")
    missing = active - rnd.submitted
    deadline = rnd.opened_at + cfg.round_timeout_s
    if not missing and n >= quorum:
        return Decision("close", f"all {len(active)} active participants submitted")
    if now >= deadline:
        late = now - rnd.opened_at
        if n >= quorum:
            return Decision(
                "close",
                f"deadline of {cfg.round_timeout_s:g}s passed ({late:.0f}s open) with {n} submissions "
                f"(min_participants {quorum}); missing: {_names(missing) or 'none'}",
            )
        return Decision("wait", f"deadline passed but only {n} of min_participants {quorum} submitted")
    if not missing:
        return Decision("wait", f"{n} submitted, waiting for min_participants {quorum}")
    return Decision(
        "wait",
        f"{n}/{len(active)} submitted, waiting for {_names(missing)} (deadline in {deadline - now:.0f}s)",
    )


def stale_participants(participants: Sequence[ParticipantView], now: float, cfg: RunConfig) -> list[tuple[str, str]]:
    """Active participants silent for longer than `heartbeat_timeout_s`, each with a reason."""
    out = []
    for p in participants:
        silent = now - p.last_seen
        if p.state == ACTIVE and silent > cfg.heartbeat_timeout_s:
            out.append((p.id, f"no heartbeat for {silent:.0f}s (timeout {cfg.heartbeat_timeout_s:g}s)"))
    return out


def run_finished(version: int, cfg: RunConfig) -> bool:
    """A run with `rounds` > 0 is finished once that many rounds have committed."""
    return cfg.rounds > 0 and version >= cfg.rounds
