"""When each phase of a round's secure aggregation closes, and the round's public parameters: pure.

Phases, in order: `keys` (participants advertise public keys, and their token claims if they
know them), `shares` (each posts its sealed Shamir shares), `claims` (the token claims not made with
the keys: a participant that exchanged keys and shares at the round's start, drawing its masks
during the inner steps, claims after training; the public weights are fixed when it closes),
`upload` (masked updates come through the update route; the round's own close ends it), `reveal`
(survivors reveal the shares that unmask the sum), `done`.
Every decision takes the clock as an argument and says why, as `policy.decide_round` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.errors import FedtrainError
from fedtrain.privacy.keys import RoundTag
from fedtrain.privacy.ring import FixedPoint
from fedtrain.privacy.round_setup import RoundSetup

PHASES = ("keys", "shares", "claims", "upload", "reveal", "done")
Phase = Literal["keys", "shares", "claims", "upload", "reveal", "done"]


class SecAggRefused(FedtrainError):
    """A round's secure aggregation cannot give its aggregate (too few survivors or shares, a
    broken ring sum): the round is refused, not committed, and the same round opens again."""


@dataclass(frozen=True)
class PhaseDecision:
    action: Literal["wait", "advance", "restart"]
    reason: str


def holders(n: int, degree: int | None) -> int:
    """How many participants hold shares of one participant's secrets: itself and its neighbours."""
    if degree is None:
        return n
    return min(degree + degree % 2, n - 1) + 1


def threshold(n: int, p: Any) -> int:
    """t for a round of `n` participants: the config's, else max(2, ceil(2h/3)) of the h holders of
    each secret (more than half, as Bonawitz et al. ask, with room for a third to drop)."""
    if p.secagg_threshold is not None:
        return int(p.secagg_threshold)
    return max(2, math.ceil(2 * holders(n, p.secagg_degree) / 3))


def setup_for(run: str, session: str, round_: int, n: int, p: Any, graph_seed: bytes) -> RoundSetup:
    """The public parameters of one attempt at round `round_` with `n` participants. The tag's run
    id carries the attempt's session, so no two attempts (a refused round, a restart) share a secret."""
    fp = FixedPoint.plan(p.secagg_max_participants, p.secagg_range, p.secagg_precision_bits, p.secagg_ring_bits)
    degree = p.secagg_degree if p.secagg_degree is not None and holders(n, p.secagg_degree) < n else None
    return RoundSetup(RoundTag(f"{run[:200]}/{session}", round_), fp, threshold(n, p), degree, graph_seed)


def decide_phase(phase: Phase, expected: set[str], answered: set[str], need: int, now: float,
                 since: float | None, timeout_s: float) -> PhaseDecision:
    """Whether phase `phase` closes now. `expected`: who should answer (keys: the active
    participants; shares: those that advertised; claims: the active participants that shared;
    reveal: the survivors), `answered`: who did, `need`: the fewest answers the next phase can work
    with (t), `since`: when the phase's clock started (keys: the first advertisement; claims: the
    first claim made after the shares, since the others are still training; None: not yet)."""
    if phase in ("upload", "done"):
        return PhaseDecision("wait", f"the {phase} phase ends with the round")
    waiting = sorted(expected - answered)
    if len(answered) >= need and not waiting:
        return PhaseDecision("advance", f"{phase}: everyone expected answered ({len(answered)})")
    late = since is not None and now - since >= timeout_s
    if not late:
        who = ", ".join(waiting[:5]) or "more"
        return PhaseDecision("wait", f"{phase}: {len(answered)} answered, waiting for {who} (at least {need} needed)")
    if len(answered) >= need or phase == "reveal":  # (reveal: the unmasking says whether the shares suffice)
        return PhaseDecision("advance", f"{phase}: {timeout_s:g}s passed with {len(answered)} answer(s); "
                             f"{len(waiting)} did not answer")
    if phase in ("keys", "claims"):  # (more may still come; the round's own deadline ends the wait)
        return PhaseDecision("wait", f"{phase}: {len(answered)} answered after {timeout_s:g}s, fewer than the "
                             f"{need} a round needs; waiting for more")
    return PhaseDecision("restart", f"{phase}: only {len(answered)} answered in {timeout_s:g}s, fewer than t = "
                         f"{need}; the round's secure aggregation starts again with fresh keys")
