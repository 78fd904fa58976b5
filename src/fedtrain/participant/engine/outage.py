"""Riding out a coordinator outage on the participant side: train on, retry later, give up in bounded time.

When a sync cannot reach the coordinator (connection refused while it restarts, timeouts,
5xx), the participant does not exit and does not block its training loop: it puts its
round snapshot back, keeps taking inner steps, and tries the sync again after a backoff.
When the coordinator answers again, the participant submits to the round it is in (the
coordinator's uploads are idempotent per round and participant, so a resend is safe), or
moves on to the current global model if that round has closed meanwhile. Only when the
outage has lasted `budget_s` does `CoordinatorUnavailable` reach the user's loop.

`next_attempt` is the pure decision: (outage state, now, policy) -> (decision, reason).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from fedtrain.errors import AuthError, CoordinatorError, CoordinatorUnavailable, NotACoordinatorError, TLSError


@dataclass(frozen=True)
class OutagePolicy:
    """How a participant behaves while its coordinator cannot be reached. Seconds."""

    budget_s: float | None = None  # total time training on alone; None: the client's retry.max_elapsed_s
    attempt_s: float = 10.0  # retry budget of one sync attempt (the training loop waits at most this)
    backoff_initial_s: float = 1.0  # wait before the second attempt; doubles each failed attempt
    backoff_max_s: float = 10.0

    def attempt_window(self, budget_s: float) -> float:
        """The retry budget of each call of one sync attempt under an outage budget of `budget_s`:
        `attempt_s`, but never more than the whole budget (a `--give-up-after 2` participant
        would otherwise retry its upload for 10 s before its outage had even begun)."""
        return min(self.attempt_s, budget_s)


@dataclass
class OutageState:
    since: float | None = None  # monotonic time of the first failed attempt; None: no outage
    attempts: int = 0
    next_at: float = 0.0
    last_error: str = ""

    @property
    def active(self) -> bool:
        return self.since is not None

    def retry_in(self, delay_s: float) -> None:
        """A sync attempt failed and the next one comes in `delay_s` (rank 0's decision, on every
        rank): the outage is counted and the time of the next attempt set."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        self.attempts += 1
        self.next_at = now + delay_s

    def ended(self, r: int, *, quiet: bool = False) -> dict[str, Any] | None:
        """Round r synced: the record of the outage being ridden out, if any ({"round", "seconds",
        "attempts"}, logged unless `quiet`); the caller starts a fresh state."""
        if self.since is None:
            return None
        seconds = time.monotonic() - self.since
        if not quiet:
            logging.getLogger("fedtrain.participant").warning("the coordinator is back after %.0fs; synced round %d",
                                                              seconds, r)
        return {"round": r, "seconds": round(seconds, 2), "attempts": self.attempts + 1}


@dataclass(frozen=True)
class Attempt:
    action: Literal["retry_later", "give_up"]
    delay_s: float
    reason: str


def next_attempt(state: OutageState, now: float, policy: OutagePolicy, budget_s: float) -> Attempt:
    """After a failed sync attempt: when to try again, or that the outage has lasted too long."""
    since = now if state.since is None else state.since
    spent = now - since
    if spent >= budget_s:
        return Attempt(
            "give_up",
            0.0,
            f"the coordinator has been unreachable for {spent:.0f}s (budget {budget_s:g}s, "
            f"{state.attempts + 1} attempts): {state.last_error}",
        )
    delay = min(policy.backoff_initial_s * 2**state.attempts, policy.backoff_max_s, budget_s - spent)
    return Attempt(
        "retry_later",
        delay,
        f"coordinator unreachable for {spent:.0f}s ({state.last_error}); training on locally, "
        f"next sync attempt in {delay:.1f}s (giving up after {budget_s:g}s)",
    )


def is_transient(error: BaseException) -> bool:
    """Errors a participant rides out: no answer, or the coordinator's own failure (5xx).
    Never a refused token, a TLS mismatch or an address that is not a coordinator."""
    if isinstance(error, (AuthError, NotACoordinatorError, TLSError)):
        return False
    if isinstance(error, CoordinatorUnavailable):
        return True
    return isinstance(error, CoordinatorError) and error.status >= 500
