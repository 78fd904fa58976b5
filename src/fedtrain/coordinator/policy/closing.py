"""Pure decisions about the round: when it closes (`decide_round`, its adaptive deadline), who
has gone silent, when the run is over, when a config change is in force, what state a round
is in. Each returns its decision with a reason in words and takes the time as an argument.
See docs/architecture.md (policy)."""

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
    deadline_s: float | None = None  # this round's deadline after opening; None: cfg.round_timeout_s


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
    timeout = cfg.round_timeout_s if rnd.deadline_s is None else rnd.deadline_s
    deadline = rnd.opened_at + timeout
    if not missing and n >= quorum:
        return Decision("close", f"all {len(active)} active participants submitted")
    if now >= deadline:
        late = now - rnd.opened_at
        if n >= quorum:
            return Decision(
                "close",
                f"deadline of {timeout:g}s passed ({late:.0f}s open) with {n} submissions "
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


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def adaptive_deadline(submit_times: Sequence[Sequence[float]], cfg: RunConfig) -> tuple[float, str]:
    """The next round's deadline (seconds after it opens) and why.

    `submit_times` holds, for each recently closed round (oldest first), the seconds each
    submission took after the round opened. The median of those, over the last
    `deadline_window` rounds, is what a typical participant needs; stragglers do not move
    it. The deadline is `deadline_factor` times that, within [deadline_min_s, round_timeout_s].
    """
    cap = cfg.round_timeout_s
    if cfg.deadline != "adaptive":
        return cap, f"fixed deadline of {cap:g}s"
    recent = [t for times in list(submit_times)[-cfg.deadline_window :] for t in times]
    if not recent:
        return cap, f"adaptive deadline: no submit times observed yet, using round_timeout_s {cap:g}s"
    typical = _median(recent)
    wanted = cfg.deadline_factor * typical
    chosen = min(max(wanted, cfg.deadline_min_s), cap)
    bound = " (at deadline_min_s)" if chosen > wanted else (" (capped at round_timeout_s)" if chosen < wanted else "")
    return chosen, (
        f"adaptive deadline {chosen:.1f}s{bound}: {cfg.deadline_factor:g} x median submit time {typical:.1f}s "
        f"over {len(recent)} submissions"
    )


def change_effective(round_: int, started: bool) -> tuple[int, str]:
    """The round a config change accepted during open round `round_` is in force from, and
    why: the next one, unless no one has started this one (`started`: an update is in or
    a participant is active), when it is in force at once."""
    if started:
        return round_ + 1, f"participants are training round {round_} with the config in force"
    return round_, f"no one has started round {round_}"


def round_state(round_: int, current: int, committed: int, closing: bool, finished: bool) -> tuple[str, str]:
    """The state of round `round_` when `current` is open (or the run `finished` there) and
    versions up to `committed` are durable, and why: closed (merged and committed),
    committing (merged, its checkpoint not yet durable), open, closing, finished, not_open."""
    if round_ < current:
        if round_ < committed:
            return "closed", f"round {round_} was merged and committed"
        return "committing", f"round {round_} was merged; its checkpoint is being made durable"
    if round_ == current:
        if finished:
            return "finished", f"the run finished after {current} rounds"
        if closing:
            return "closing", f"round {round_} is being merged"
        return "open", f"round {round_} is open"
    return "not_open", f"round {round_} has not opened; the current round is {current}"
