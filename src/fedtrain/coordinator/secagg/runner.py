"""`SecureAggregation`: the run's secure aggregation, one attempt per open round, driven by the
round's tick and by the participants' requests; the round loop asks it to unmask at the close.

Restart mid-round: the simplest correct behaviour. A coordinator never loads a partial round, so
a restarted one opens the round with a fresh attempt (new session, fresh keys); a participant's
request of the old session is refused (409 secagg_session) and it runs the round's steps again
with the update it holds. The same holds when a round's attempt is refused (too few survivors or
shares): the round is not committed, and it opens again with a fresh attempt. Event loop only,
except `aggregate_into` (the merge's worker thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedtrain.coordinator.secagg.attempt import Attempt, conflict
from fedtrain.coordinator.secagg.phases import PHASES, SecAggRefused, decide_phase, threshold
from fedtrain.coordinator.state.events import Events
from fedtrain.errors import Refused
from fedtrain.merge import RunningSum
from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import PublicKeys
from fedtrain.privacy.shamir import Share
from fedtrain.privacy.unmask import RevealedShare

#: The longest a state request long-polls.
MAX_WAIT_S = 60.0


@dataclass(frozen=True)
class RoundLink:
    """What the round loop lends the secure aggregation. `shapes(round)`: the names and shapes of
    the tensors round `round` syncs (the whole sync set, or with Streaming DiLoCo the round's
    fragment: the masked uploads and the ring sum hold those only); `active()`: the active
    participants (the keys phase waits for them); `count_tokens(pid, round, claim)`: the tokens a
    claim counts as (`policy.count_tokens`); `weigh(claims)`: the round's public weights of the claims."""

    shapes: Callable[[int], Mapping[str, tuple[int, ...]]]
    active: Callable[[], set[str]]
    count_tokens: Callable[[str, int, int], int]
    weigh: Callable[[dict[str, int]], dict[str, float]]


class SecureAggregation:
    """The open round's attempt and its moves, over what the round loop lends it (`RoundLink`)."""

    def __init__(self, privacy: Any, run: str, shapes: Callable[[int], Mapping[str, tuple[int, ...]]], round_: int,
                 events: Events,
                 clock: Callable[[], float], active: Callable[[], set[str]],
                 count_tokens: Callable[[str, int, int], int],
                 weigh: Callable[[dict[str, int]], dict[str, float]]) -> None:
        self.privacy = privacy
        self._run = run
        self._events = events
        self.clock = clock
        self._link = RoundLink(shapes, active, count_tokens, weigh)
        self.refused = 0  # attempts refused since the start (too few answers or shares)
        self.attempt = self._new(round_)

    def _new(self, round_: int) -> Attempt:
        link = self._link
        return Attempt(round_, self._run, self.privacy, link.shapes(round_), self.clock(), link.weigh)

    # -- the round loop's side ----------------------------------------------------------------------

    def open_round(self, round_: int) -> None:
        """Round `round_` is the open one (the next, or the same after a refusal): a fresh attempt."""
        self.attempt = self._new(round_)
        self._events.notify()

    def restart(self, why: str) -> None:
        """The open round's attempt cannot go on: a fresh one, same round."""
        self.refused += 1
        self._events.record("secagg", f"round {self.attempt.round}: {why}")
        self.open_round(self.attempt.round)

    def tick(self) -> None:
        """Close the phase whose answers are in or whose time is up (keys, shares, claims; reveal
        is waited for by `unmask`). On the round's tick and after each answer."""
        a, now, active = self.attempt, self.clock(), self._link.active()
        timeout = self.privacy.secagg_phase_timeout_s
        if a.phase == "keys":
            need = self.privacy.secagg_threshold or 2
            d = decide_phase("keys", active | a.advertised(), a.advertised(), need, now, a.since, timeout)
            a.reason = d.reason
            if d.action == "advance":
                a.close_keys(now)
                self._events.notify()
        elif a.phase == "shares":
            assert a.setup is not None
            d = decide_phase("shares", a.advertised(), a.sharing(), a.setup.threshold, now, a.since, timeout)
            a.reason = d.reason
            if d.action == "advance":
                a.close_shares(now)
                self._events.notify()
                self.tick()  # the claims phase closes at once when every claim came with the keys
            elif d.action == "restart":
                self.restart(d.reason)
        elif a.phase == "claims":
            assert a.setup is not None
            d = decide_phase("claims", (a.sharing() & active) | a.claimed(), a.claimed() & a.sharing(),
                             a.setup.threshold, now, a.since, timeout)
            a.reason = d.reason
            if d.action == "advance":
                a.close_claims(now)
                self._events.notify()

    def all_in(self, submitted: set[str]) -> bool:
        """Every participant that can upload this round has: the round need not wait for more."""
        a = self.attempt
        return a.phase == "upload" and bool(a.weights) and a.pids(set(a.weights)) <= submitted

    async def unmask(self) -> None:
        """At the round's close (no fold in flight): ask the survivors for their shares and wait for
        them, or for the phase's time (then the unmasking says whether the shares suffice)."""
        a = self.attempt
        if a.phase != "upload":
            raise SecAggRefused(f"round {a.round} closed in its secure aggregation's {a.phase} phase: no masked "
                                "update can be unmasked")
        a.close_upload(self.clock())
        a.reason = "reveal: waiting for the survivors' shares"
        self._events.notify()
        survivors = a.uploaded()
        need = a.setup.threshold if a.setup is not None else 2
        if len(survivors) < need:  # (survivors refuse to reveal for fewer than t: no need to wait)
            raise SecAggRefused(f"{len(survivors)} masked upload(s), fewer than t = {need}: the sum cannot be "
                                "unmasked")
        while True:
            d = decide_phase("reveal", survivors, a.revealed(), need, self.clock(), a.since,
                             self.privacy.secagg_phase_timeout_s)
            a.reason = d.reason
            if d.action != "wait":
                return
            if not await self._events.wait_changed(0.5):
                await _sleep(0.05)  # (no notifications before the start)

    def aggregate_into(self, acc: RunningSum) -> dict[str, float]:
        """Worker thread, under the fold lock, the sum empty: the survivors' token-weighted mean
        into `acc` as its one contribution (weight 1); returns the survivors' shares of it.
        Raises SecAggRefused (the sum left empty)."""
        if not acc.is_empty:  # (only masked uploads are taken: nothing else may be in it)
            raise SecAggRefused("the round's sum holds an update that is not masked: refused")
        mean, shares = self.attempt.aggregate()
        try:
            for name, t in mean.items():
                acc.fold(name, t, 1.0)
            acc.finish_contribution(1.0)
        except BaseException:
            acc.reset()
            raise
        self.attempt.phase = "done"
        return shares

    def view(self) -> dict[str, Any]:
        """The status's `secure_aggregation`."""
        a = self.attempt
        return {"round": a.round, "session": a.session, "phase": a.phase, "reason": a.reason,
                "participants": len(a.advertised()), "sharing": len(a.sharing()), "uploaded": len(a.uploaded()),
                "threshold": a.setup.threshold if a.setup is not None else threshold(max(len(a.advertised()), 2),
                                                                                      self.privacy),
                "ring_bits": a.setup.fixed_point.bits if a.setup is not None else None,
                "refused_attempts": self.refused}

    # -- the routes' side ----------------------------------------------------------------------------

    def current(self, round_: int) -> Attempt:
        a = self.attempt
        if round_ != a.round:
            raise conflict("round_not_open", f"round {round_} is not the open round ({a.round})",
                           current_round=a.round)
        return a

    async def state(self, pid: str | None, round_: int, wait_s: float, phase: str | None,
                    session: str | None) -> dict[str, Any]:
        """The attempt's state; with `phase` (and `session`), long-polled up to `wait_s` while the
        attempt is still that session in that phase. A participant asking in the keys phase is
        given its id."""
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_WAIT_S))
        while True:
            a = self.current(round_)
            if pid is not None:
                a.enrol(pid)
            moved = phase is None or a.phase != phase or (session is not None and a.session != session)
            if moved or not await self._events.wait_changed(deadline - time.monotonic()):
                return self.current(round_).view(pid)

    def advertise(self, pid: str, round_: int, session: str, keys: dict[str, str],
                  tokens: int | None) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "keys")
        try:
            public = PublicKeys.from_json(keys)
        except PrivacyError as e:
            raise Refused(400, "secagg_keys", e.args[0]) from None
        counts = None if tokens is None else self._link.count_tokens(pid, round_, tokens)
        i = a.advertise(pid, public, counts, self.clock())
        counted = a.claim(pid)
        self.tick()  # the phase closes at once when every active participant's keys are in
        self._events.notify()
        return {"id": i, "session": a.session, "tokens_counted": counted}

    def claim(self, pid: str, round_: int, session: str, tokens: int) -> dict[str, Any]:
        """A token claim after the shares (keys and shares were exchanged before training)."""
        a = self.current(round_)
        a.check(session, "shares", "claims")
        a.post_claim(pid, self._link.count_tokens(pid, round_, tokens), self.clock())
        self.tick()  # the phase closes at once when every participant that shared has claimed
        self._events.notify()
        return {"session": a.session, "tokens_counted": a.claim(pid)}

    def directory(self, pid: str, round_: int, session: str) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "shares", "claims", "upload", "reveal")
        return a.directory(pid)

    def post_shares(self, pid: str, round_: int, session: str, shares: dict[str, str]) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "shares")
        try:
            sealed = {int(k): bytes.fromhex(v) for k, v in shares.items()}
        except ValueError as e:
            raise Refused(400, "secagg_shares", f"shares are {{recipient id: hex}}: {e}") from None
        a.post_shares(pid, sealed)
        self.tick()  # the phase closes at once when every participant's shares are in
        self._events.notify()
        return {"accepted": True, "session": a.session}

    def mailbox(self, pid: str, round_: int, session: str) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "claims", "upload", "reveal")
        return a.mailbox(pid)

    def unmask_request(self, pid: str, round_: int, session: str) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "reveal")
        return a.unmask_request(pid)

    def post_reveal(self, pid: str, round_: int, session: str, shares: list[dict[str, Any]]) -> dict[str, Any]:
        a = self.current(round_)
        a.check(session, "reveal")
        me = a.id_of(pid)
        if me is None:
            raise conflict("secagg_not_member", f"{pid} takes no part in round {round_}'s secure aggregation")
        try:
            revealed = [RevealedShare(int(s["owner"]), str(s["kind"]), Share.from_bytes(me, bytes.fromhex(s["share"])))
                        for s in shares]
        except (PrivacyError, KeyError, ValueError) as e:
            raise Refused(400, "secagg_reveal", f"revealed shares are [{{owner, kind, share: hex}}]: {e}") from None
        a.post_reveal(pid, revealed)
        self._events.notify()
        return {"accepted": True, "session": a.session}

    # -- the intake's side (`intake/flow.py`: a masked upload) -------------------------------------

    def admit(self, pid: str, round_: int, tokens: int) -> Attempt:
        """The attempt a masked upload of `pid` goes into (its `check_header`, then its `fold` on a
        worker thread), or Refused before a byte of it is read."""
        a = self.attempt
        if round_ != a.round:
            raise conflict("round_closed", f"round {round_} is not the open round ({a.round})", current_round=a.round)
        a.admit(pid, tokens)
        return a


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


__all__ = ["PHASES", "SecAggRefused", "SecureAggregation"]
