"""Pure decisions of the coordinator: when a round closes, who has gone silent, how much a
token claim counts, and which of a round's updates may be folded into the sum yet.

Every rule is a function of (state, now, config) that returns its decision together with
a reason in words; the reason is logged and shown to users. Nothing here reads a clock,
a socket or a file, so each rule is tested by passing the time in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class Admission:
    action: Literal["accept", "late", "refuse"]
    reason: str
    staleness: int = 0
    code: str = ""


def admit_upload(round_: int, version: int, closing: bool, finished: bool, cfg: RunConfig) -> Admission:
    """Whether an upload for `round_` is taken into the open round `version`, and how.

    accept: it is for the open round. late: it is for a round that closed at most
    `max_staleness` rounds ago and `late_uploads` is "fold" (it joins the open round with
    a discounted weight). refuse: everything else, with the 409 code to answer.
    """
    if finished:
        return Admission("refuse", f"the run finished after {version} rounds", code="run_finished")
    if round_ == version and not closing:
        return Admission("accept", f"round {round_} is open")
    if round_ > version:
        return Admission("refuse", f"round {round_} is not open; the current round is {version}", code="round_closed")
    if round_ == version:
        return Admission("refuse", f"round {round_} is closing; the current round is {version}", code="round_closed")
    staleness = version - round_
    if cfg.late_uploads == "fold" and staleness <= cfg.max_staleness and not closing:
        return Admission(
            "late",
            f"round {round_} closed {staleness} round(s) ago; folded into round {version} with weight x "
            f"{cfg.staleness_discount**staleness:g}",
            staleness,
        )
    why = "" if cfg.late_uploads == "refuse" else f" (more than max_staleness {cfg.max_staleness} behind)"
    return Admission(
        "refuse", f"round {round_} is closed{why}; the current round is {version}", staleness, code="round_closed"
    )


# -- what one participant's update may weigh ----------------------------------------------------

MIN_FOR_CAP = 3  # with two updates a cap of one half is uniform weighting: token weighting would be gone
_TOLERANCE = 1e-12


def _normalised(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    if not weights or not math.isfinite(total) or total <= 0 or any(w < 0 for w in weights.values()):
        raise ValueError(f"weights must be finite, not negative and not all 0: {dict(weights)}")
    return {k: w / total for k, w in weights.items()}


def over_share(weights: Mapping[str, float], max_share: float) -> set[str]:
    """The updates whose share of `weights` is above `max_share` now. A share only falls as
    updates come in, so an update not named here is never capped later (for max_share of one
    half or more: then at most one update is capped, and the others share the rest)."""
    if max_share >= 1 or not weights:
        return set()
    return {k for k, share in _normalised(weights).items() if share > max_share * (1 + _TOLERANCE)}


def cap_shares(weights: Mapping[str, float], max_share: float,
               min_count: int = MIN_FOR_CAP) -> tuple[dict[str, float], dict[str, str]]:
    """Normalised shares wᵢ / Σ w with none above `max_share`, and a reason for each capped one.

    Water-filling: an update whose share is above the cap gets the cap, and what is left
    (1 − cap per capped update) goes to the others in proportion to their weights; repeat
    until no share is above it. With fewer than `min_count` updates nothing is capped; when
    the cap cannot be met (fewer than 1 / max_share updates) every update gets 1 / n, as
    close to it as shares summing to 1 can be.
    """
    shares = _normalised(weights)
    if max_share >= 1 or len(shares) < min_count:
        return shares, {}
    n = len(shares)
    capped: set[str] = set()
    out = {k: 1.0 / n for k in shares}  # what is left when the cap cannot be met
    while len(capped) < n:
        free = 1.0 - max_share * len(capped)
        rest = {k: w for k, w in weights.items() if k not in capped}
        total = sum(rest.values())
        trial = {k: (free * w / total if total > 0 else free / len(rest)) for k, w in rest.items()}
        over = {k for k, v in trial.items() if v > max_share * (1 + _TOLERANCE)}
        if not over:
            out = {**trial, **{k: max_share for k in capped}}
            break
        capped |= over
    how = ("the rest went to the other updates in proportion to their weights" if max_share * n >= 1
           else f"{n} updates cannot all stay under it, so each has 1/{n}")
    reasons = {
        k: f"share {shares[k]:.3g} capped at {out[k]:.3g} (max_share {max_share:g}); {how}"
        for k in sorted(shares) if out[k] < shares[k] * (1 - _TOLERANCE)
    }
    return out, reasons


def largest_influence(shares: Mapping[str, float], max_abs: Mapping[str, float]) -> tuple[str, str]:
    """The update with the largest share × max |value|: the most any one update adds to a
    value of the merge (|Σ sᵢΔᵢ| ≤ Σ sᵢ·maxᵢ), so the one to refuse when the merge is not
    finite; with the reason in words. An update whose largest value is not known counts as Inf."""
    if not shares:
        raise ValueError("no updates to choose from")
    key = max(sorted(shares), key=lambda k: shares[k] * max_abs.get(k, math.inf))
    return key, (f"of the {len(shares)} updates it moves the merge the most: share {shares[key]:.3g} "
                 f"x largest value {max_abs.get(key, math.inf):.3g}")



def token_bound(cfg: RunConfig) -> tuple[int, str]:
    """The most tokens one update may count for: a round's schedule (H inner steps of
    batch_size sequences of seq_len tokens; in balanced rounds the most steps a participant
    may be told, max_steps_factor x H) times `outer.token_slack`, and how it is made."""
    t, s = cfg.train, cfg.schedule
    factor = s.max_steps_factor if s.mode == "balanced" else 1.0
    bound = math.ceil(t.sync_every * factor * t.batch_size * t.seq_len * cfg.outer.token_slack)
    most = f" x schedule.max_steps_factor {factor:g}" if s.mode == "balanced" else ""
    return bound, (f"train.sync_every {t.sync_every}{most} x batch_size {t.batch_size} x seq_len {t.seq_len} x "
                   f"outer.token_slack {cfg.outer.token_slack:g} = {bound:,}")


def count_tokens(claimed: int, cfg: RunConfig) -> tuple[int, str | None]:
    """How many of a participant's `claimed` tokens count (they set its weight), and why when
    not all: a claim above `token_bound` counts as the bound. Counted, not refused: a
    torchrun group, or a participant that trained on through an outage, honestly claims more
    than one rank's schedule, and a refusal would stop its training."""
    bound, why = token_bound(cfg)
    if claimed <= bound:
        return claimed, None
    return bound, f"claimed {claimed:,} tokens, more than a round's schedule allows ({why}); counted as {bound:,}"


@dataclass(frozen=True)
class Contribution:
    """One update of the open round, as the merge sees it."""

    weight: float  # its fold weight: tokens (or 1), times any staleness discount
    max_abs: float  # its largest |value|
    folded: bool  # in the running sum; else waiting in its spool file


def to_fold(entries: Mapping[str, Contribution], max_share: float, may_reach: int) -> list[str]:
    """Which waiting updates may be folded into the running sum now, so that the round's close
    can still cap any update at `max_share` of the merge (`cap_shares`) with the others
    already summed.

    The sum can be reweighted only as a whole, so it may hold at most one update that could
    still be capped: one whose share of the round so far is above the cap (`over_share`;
    shares only fall as updates come in). Such an update waits in its spool file, unless
    the sum is empty (it is then the sum, alone), and while the sum's one update could be
    capped the others wait. Nothing waits when no cap can apply: max_share 1, or a round
    that cannot reach MIN_FOR_CAP updates (`may_reach`: the updates in, plus the active
    participants yet to send one). Below one half (more than one update can be capped)
    the coordinator keeps every update until the close instead (`retain_all`).
    """
    waiting = [k for k, e in entries.items() if not e.folded]
    if max_share >= 1 or may_reach < MIN_FOR_CAP:
        return waiting
    risky = over_share({k: e.weight for k, e in entries.items()}, max_share)
    folded = [k for k, e in entries.items() if e.folded]
    if any(k in risky for k in folded):
        return []
    ready = [k for k in waiting if k not in risky]
    if not folded and not ready and waiting:
        ready = waiting[:1]
    return ready


def retain_all(max_share: float) -> bool:
    """Whether every update must wait on disk for the close to be capped exactly: below one
    half, several updates can end up capped and which ones is known only at the close."""
    return max_share < 0.5


def closing_weights(entries: Mapping[str, Contribution],
                    max_share: float) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """At the close: each update's share of the merge (capped, `cap_shares`), the weight to
    fold each waiting one with so that the sum gives those shares (in the units of the
    weights already folded), and a reason for each capped share.

    If a share to cap was folded together with others (a participant joined after the sum
    took two updates, while the cap could not apply), it cannot be taken apart: the round is
    merged uncapped, and the reason says so."""
    weights = {k: e.weight for k, e in entries.items()}
    shares, reasons = cap_shares(weights, max_share)
    folded = [k for k, e in entries.items() if e.folded]
    if len(folded) > 1 and any(k in reasons for k in folded):
        total = sum(weights.values())
        shares = {k: w / total for k, w in weights.items()}
        reasons = {k: f"share above max_share {max_share:g}, but already summed with other updates when the "
                      "cap came to apply: not capped this round" for k in reasons}
    in_sum = sum(shares[k] for k in folded)
    unit = sum(weights[k] for k in folded) / in_sum if folded and in_sum > 0 else 1.0
    return shares, {k: shares[k] * unit for k, e in entries.items() if not e.folded}, reasons


# -- how an upload is received and placed, when a change is in force, what state a round is in --

# At most this many active participants for a direct receive. The others' uploads are
# answered at once but fold only after it is counted, so if it ends last their folds
# follow it instead of overlapping the network; with three of them at most, that delay is
# about what the direct receive saves.
DIRECT_MAX_ACTIVE = 4


def keeps_every_update(cfg: RunConfig) -> tuple[bool, str]:
    """Whether the round keeps every update in its spool file until the close, and why: an
    aggregator that needs them all at once, the outlier rule, or a cap below one half."""
    outer = cfg.outer
    if outer.aggregator != "mean":
        return True, f"the {outer.aggregator} aggregator needs every update at once"
    if outer.outlier_factor is not None:
        return True, "outlier_factor compares every update's norm at the close"
    if retain_all(outer.max_share):
        return True, f"max_share {outer.max_share:g} (below one half) is applied exactly only at the close"
    return False, "updates are folded as they come"


@dataclass(frozen=True)
class ReceivePath:
    path: Literal["direct", "spool"]
    reason: str


def receive_path(*, fast_io: bool, action: str, sum_empty: bool, active: int, plain: bool, fits: bool,
                 cfg: RunConfig) -> ReceivePath:
    """Where an upload's body goes as it streams in: straight into the (empty) running sum
    (`direct`: no spool file, no read-back) or into a spool file (`spool`), and why.

    `action`: its admission (`admit_upload`); `sum_empty`: nothing folded, folding or being
    received into the sum; `active`: the active participants; `plain`: an uncompressed body;
    `fits`: its tensors are the sum's (names, dtypes, shapes)."""
    outer = cfg.outer
    if not fast_io:
        return ReceivePath("spool", "the fast IO paths are off (FEDTRAIN_FAST_IO)")
    if cfg.schedule.mode == "async":
        return ReceivePath("spool", "asynchronous mode: an update waits in its spool file for the version it is "
                                    "applied to")
    if action != "accept":
        return ReceivePath("spool", "a late update is folded from its spool file")
    if not sum_empty:
        return ReceivePath("spool", "the sum already holds or receives an update")
    if active > DIRECT_MAX_ACTIVE:
        return ReceivePath("spool", f"{active} participants are active, more than {DIRECT_MAX_ACTIVE}: the others' "
                                    "folds would wait on this one's link")
    keep, why = keeps_every_update(cfg)
    if keep:
        return ReceivePath("spool", why)
    if outer.clip_norm is not None:
        return ReceivePath("spool", "clip_norm needs the update's norm before it is weighted")
    if cfg.late_uploads == "fold":
        return ReceivePath("spool", "with late_uploads=fold an update whose round closes while it streams in is "
                                    "folded into the next one, from its file")
    if not plain:
        return ReceivePath("spool", "a compressed update is decoded from its spool file")
    if not fits:
        return ReceivePath("spool", "the update's tensors are not laid out as the sum's")
    return ReceivePath("direct", "the round's first update, plain and of the sum's layout: received into the sum")


@dataclass(frozen=True)
class Placement:
    """What happens to a verified spooled update: `keep` it in its file until the close, `fold`
    it now (its values checked as it is folded), or check it now and `fold_after` the upload
    being received into the sum is counted; `check_first`: its values are checked before
    it is placed (not as it is folded)."""

    action: Literal["keep", "fold", "fold_after"]
    check_first: bool
    reason: str


def place_update(cfg: RunConfig, direct_in_progress: bool) -> Placement:
    """How a verified spooled update is placed in the open round, and why."""
    keep, why = keeps_every_update(cfg)
    if keep:
        return Placement("keep", True, why)
    if cfg.outer.clip_norm is not None:
        return Placement("fold", True, "clip_norm scales the update by its norm before the fold")
    if direct_in_progress:
        return Placement("fold_after", True, "the sum is the update being received into it until that one is "
                                             "counted: answered now, folded then")
    return Placement("fold", False, "checked as it is folded (one read of its file)")


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
