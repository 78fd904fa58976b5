"""Pure decisions of asynchronous mode (`schedule.mode: async`): what an update's staleness
is and whether it is taken, what it weighs, when its version closes, and N of the delayed
Nesterov step. Like the rest of `policy/`, each rule returns its decision with a reason in words, and
none reads a clock, a socket or a file.

More: docs/architecture.md, "coordinator/policy/async_rules.py".
"""

from __future__ import annotations

from collections.abc import Mapping

from fedtrain.config import RunConfig
from fedtrain.coordinator.policy.admission import Admission
from fedtrain.coordinator.policy.closing import Decision
from fedtrain.merge.staleness import staleness_factor


def admit(round_: int, version: int, closing: bool, finished: bool, cfg: RunConfig) -> Admission:
    """Whether an update trained from version `round_` is taken while the open round is
    `version` (`closing`: its update is being applied, so this one goes into the next), with
    its staleness; refuse says the code to answer (409 round_closed, too_stale, run_finished; 422
    invalid_version: a base version that never existed, below 0)."""
    if finished:
        return Admission("refuse", f"the run finished after {version} versions", code="run_finished")
    if round_ < 0:  # (the API refuses it first: a staleness beyond the versions there are)
        return Admission("refuse", f"version {round_} never existed: an update is trained from a version 0 to "
                         f"{version}", code="invalid_version")
    if round_ > version:
        return Admission("refuse", f"version {round_} does not exist yet; the global model is at version {version}",
                         code="round_closed")
    staleness = version - round_ + (1 if closing else 0)
    bound = cfg.asynchronous.max_staleness
    if staleness > bound:
        return Admission(
            "refuse",
            f"the update was trained from version {round_}, {staleness} versions behind the global model (version "
            f"{version}), more than asynchronous.max_staleness {bound}",
            staleness,
            code="too_stale",
        )
    return Admission("accept", f"trained from version {round_}: staleness {staleness}, applied as it comes", staleness)


def weight(staleness: int, cfg: RunConfig) -> tuple[float, str]:
    """α(s), the factor an update of staleness `staleness` is applied with, and how it is made."""
    a = cfg.asynchronous
    factor = staleness_factor(staleness, a.staleness_fn, a.staleness_exponent, a.staleness_hinge)
    if a.staleness_fn == "constant":
        how = "staleness_fn constant"
    elif a.staleness_fn == "polynomial":
        how = f"(1 + {staleness})^-{a.staleness_exponent:g}"
    elif staleness <= a.staleness_hinge:
        how = f"hinge: staleness {staleness} <= staleness_hinge {a.staleness_hinge}"
    else:
        how = f"hinge: 1 / (1 + {a.staleness_exponent:g} x ({staleness} - {a.staleness_hinge}))"
    return factor, f"weight x{factor:.3g} ({how})"


def scale(tokens: Mapping[str, int], staleness: Mapping[str, int], cfg: RunConfig) -> float:
    """What the round's weighted mean is multiplied by before the outer step: Σ wᵢ·α(sᵢ) / Σ wᵢ,
    with wᵢ the update's fold weight (tokens, or 1 with uniform weighting), so that each update
    counts α(sᵢ) of itself. A round of one update (the rule in asynchronous mode) gives α(s)."""
    w = {k: (float(t) if cfg.outer.weighting == "tokens" else 1.0) for k, t in tokens.items()}
    total = sum(w.values())
    if not w or total <= 0:
        return 1.0
    return sum(w[k] * weight(staleness.get(k, 0), cfg)[0] for k in w) / total


def decide(round_: int, staleness: Mapping[str, int], cfg: RunConfig) -> Decision:
    """Close the open round as soon as it holds an update: there is no barrier to wait for."""
    if not staleness:
        return Decision("wait", f"asynchronous: version {round_} waits for the next update")
    parts = []
    for key in sorted(staleness):
        s = staleness[key]
        parts.append(f"{key}'s update (trained from version {round_ - s}, staleness {s}, {weight(s, cfg)[1]})")
    return Decision("close", f"asynchronous: {', '.join(parts)} applied at once")


def momentum_period(active: int, cfg: RunConfig) -> tuple[int, str]:
    """N of the delayed Nesterov step (updates per momentum step), and why: the configured
    `asynchronous.momentum_every`, or the number of active participants (at least 1)."""
    fixed = cfg.asynchronous.momentum_every
    if fixed is not None:
        return fixed, f"asynchronous.momentum_every {fixed}"
    n = max(1, active)
    return n, f"{active} active participant(s)" + ("" if active >= 1 else ", at least 1")


def submitted_before(rounds_with_update: int | None, round_: int) -> bool:
    """Whether a participant's upload trained from `round_` is one it sent before: its newest
    recorded update (`rounds_with_update`: the newest round it has an update in, None if none)
    went into round `round_` or later. A participant trains from each version it downloads at
    most once, and every update it sent before trained from an older version went into a round
    before the one it then downloaded, so an update in round ≥ `round_` can only be this one."""
    return rounds_with_update is not None and rounds_with_update >= round_
