"""How long one call to the coordinator may take: `Timeouts` (per network phase) and
`RetryPolicy` (the backoff and total budget of its retries).

A client holds one default of each; a call that must give up sooner (a sync attempt during
an outage, a goodbye) passes its own `RetryPolicy` with `retry=`, so no thread ever changes
the policy of a client that others share.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import httpx

__all__ = ["RetryPolicy", "Timeouts"]


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `read` bounds the silence between two bytes, so it covers long-polls too."""

    connect: float = 5.0
    read: float = 90.0
    write: float = 90.0
    pool: float = 10.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff of one call to the coordinator. Seconds, counted in waits between attempts."""

    initial_s: float = 0.5  # the first wait; doubles after each failed attempt
    max_backoff_s: float = 10.0  # the longest single wait
    max_elapsed_s: float = 300.0  # all the waits of one call, once the coordinator has answered this client
    first_contact_s: float = 20.0  # the same before it ever has (a wrong address fails sooner than an outage)

    def __post_init__(self) -> None:
        if min(self.initial_s, self.max_backoff_s, self.max_elapsed_s, self.first_contact_s) < 0:
            raise ValueError(f"RetryPolicy seconds must not be negative: {self}")

    def within(self, seconds: float) -> RetryPolicy:
        """This policy with all the waits of a call, and each single wait, bounded to `seconds`."""
        return dataclasses.replace(self, max_backoff_s=min(self.max_backoff_s, seconds), max_elapsed_s=seconds)

    def budget_s(self, first_contact: bool) -> float:
        return min(self.first_contact_s, self.max_elapsed_s) if first_contact else self.max_elapsed_s

    def next_delay(self, attempt: int, spent_s: float, *, first_contact: bool,
                   hint_s: float | None = None) -> float | None:
        """The wait (with jitter) after failed attempt number `attempt` (0 first), `spent_s`
        seconds of waits into the call; None once the budget is spent. `hint_s`: what the
        answer asked for (Retry-After), taken within [initial_s, max_backoff_s]."""
        budget = self.budget_s(first_contact)
        if spent_s >= budget:
            return None
        if hint_s is not None and math.isfinite(hint_s):
            delay = min(max(hint_s, self.initial_s, 0.01), self.max_backoff_s)
        else:
            delay = min(self.initial_s * 2**attempt, self.max_backoff_s) * (0.5 + random.random() / 2)
        return min(delay, budget - spent_s)
