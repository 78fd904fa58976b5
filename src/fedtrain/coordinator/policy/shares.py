"""Pure decisions about what one participant's update may weigh: token claims and their
bound, the `max_share` cap, and which updates may be folded into the sum before the close.
See docs/architecture.md (policy)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedtrain.config import MAX_UPDATE_TOKENS, RunConfig

# -- what one participant's update may weigh ----------------------------------------------------

MIN_FOR_CAP = 2  # one update alone is the whole merge: nothing to cap it against
_TOLERANCE = 1e-12
MAX_SUM = 2**53 - 1
"""Token sums (a round's, a participant's over the run) stop here: every integer below it is
exact as a float too, and it is far below SQLite's 2^63 - 1. One update counts at most
`MAX_UPDATE_TOKENS` (2^40), so a sum reaches it only after 8,192 largest updates."""


def bounded_sum(counts: Iterable[int]) -> int:
    """The sum of token counts, saturated at `MAX_SUM` (a count is never negative)."""
    return min(MAX_SUM, sum(max(0, int(c)) for c in counts))


def pair_cap(max_share: float) -> float:
    """The largest share either update of a round of two may have: halfway between `max_share`
    and 1 (0.75 for the default of one half: one update weighs at most 3x the other). With two,
    a cap of one half or less would be uniform weighting; without a cap, one participant that
    claims more tokens than it trained takes the merge. `max_share` 1 turns it off."""
    return (1.0 + max_share) / 2 if max_share < 1 else 1.0


def cap_for(n: int, max_share: float) -> float:
    """The share cap of a round of `n` updates: none for one, `pair_cap` for two, else `max_share`."""
    return 1.0 if n < MIN_FOR_CAP else pair_cap(max_share) if n == 2 else max_share


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
    until no share is above it. With fewer than `min_count` updates nothing is capped; a round
    of two is capped at `pair_cap(max_share)` (`cap_for`); when the cap cannot be met (fewer
    than 1 / max_share updates) every update gets 1 / n, as close to it as shares summing to 1
    can be.
    """
    shares = _normalised(weights)
    n = len(shares)
    rule = f"max_share {max_share:g}" if n != 2 else f"a round of two: (1 + max_share {max_share:g}) / 2"
    max_share = cap_for(n, max_share)
    if max_share >= 1 or n < min_count:
        return shares, {}
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
        k: f"share {shares[k]:.3g} capped at {out[k]:.3g} ({rule}); {how}"
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



def token_bound(cfg: RunConfig, told: int | None = None) -> tuple[int, str]:
    """The most tokens one update may count for: what its participant was told to do (`told`:
    its own inner steps for the round in balanced rounds; else train.sync_every) of batch_size
    sequences of seq_len tokens, times `outer.token_slack`, never above `MAX_UPDATE_TOKENS`
    (the config refuses a schedule beyond it); and how it is made."""
    t = cfg.train
    steps = f"train.sync_every {t.sync_every}" if told is None else f"its told H {told}"
    exact = (t.sync_every if told is None else max(1, told)) * t.batch_size * t.seq_len * cfg.outer.token_slack
    bound = min(MAX_UPDATE_TOKENS, math.ceil(exact))
    return bound, (f"{steps} x batch_size {t.batch_size} x seq_len {t.seq_len} x "
                   f"outer.token_slack {cfg.outer.token_slack:g} = {bound:,}")


def count_tokens(claimed: int, cfg: RunConfig, told: int | None = None) -> tuple[int, str | None]:
    """How many of a participant's `claimed` tokens count (they set its weight), and why when
    not all: a claim above `token_bound` (of what it was told, `told`) counts as the bound.
    Counted, not refused: a torchrun group, or a participant that trained on through an
    outage, honestly claims more than one rank's schedule, and a refusal would stop its
    training."""
    bound, why = token_bound(cfg, told)
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
    the coordinator keeps every update until the close instead (`retain_all`). The cap
    checked is the smallest the round may end with (`cap_for`): `max_share` if it may reach
    three updates, the pair cap if it may reach two only.
    """
    waiting = [k for k, e in entries.items() if not e.folded]
    cap = cap_for(may_reach, max_share)
    if cap >= 1:
        return waiting
    risky = over_share({k: e.weight for k, e in entries.items()}, cap)
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
