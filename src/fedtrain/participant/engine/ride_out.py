"""`GroupOutage`: a participant's ranks ride out a coordinator outage together. It owns the outage
in progress (`OutageState`), the policy and budget, and the outages ridden out; rank 0 decides
when the group tries again or gives up (`outage.next_attempt`) and tells every rank over the
control channel, so every rank takes the same decision at the same step. Main thread only, on
every rank at once (each method enters the group's collectives). See docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fedtrain.errors import CoordinatorUnavailable
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.engine.outage import OutagePolicy, OutageState, next_attempt
from fedtrain.participant.ranks.control import Outcome, RankGroup

__all__ = ["GroupOutage"]

log = logging.getLogger("fedtrain.participant")


class GroupOutage:
    """The outage the group is riding out (if any), and those it rode out."""

    def __init__(self, ranks: RankGroup, client: CoordinatorClient, policy: OutagePolicy, budget_s: float) -> None:
        self.ranks = ranks
        self.client = client
        self.policy = policy
        self.budget_s = budget_s
        self.state = OutageState()
        self.outages: list[dict[str, Any]] = []  # each outage ridden out: {"round", "seconds", "attempts"}

    @property
    def active(self) -> bool:
        return self.state.active

    def may_attempt(self) -> bool:
        """Whether the group may try a sync now (no backoff running: rank 0's clock decides)."""
        return not self.state.active or self.ranks.rank0_says(time.monotonic() >= self.state.next_at)

    def ended(self, r: int) -> None:
        """Round r landed: an outage in progress is over (recorded)."""
        ended, self.state = self.state.ended(r, quiet=not self.ranks.lead), OutageState()
        if ended is not None:
            self.outages.append(ended)

    def failed(self, r: int, outcomes: list[Outcome], error: BaseException | None) -> None:
        """A sync attempt failed on some rank: ride it out as a group (every rank's engine has put
        its snapshot back; rank 0 decides when to try again, or to give up), or raise on every
        rank when the failure is not one to ride out."""
        self.ranks.raise_lasting(outcomes, error)
        failed = [o for o in outcomes if not o.ok]
        first = next((o for o in failed if o.code != "cancelled"), failed[0])
        self._decide(r, first.error if self.ranks.world_size == 1 else f"rank {first.rank}: {first.error}")

    def coordinator_back(self, r: int) -> bool:
        """During an outage: a cheap probe (rank 0) before spending an eval and an upload on an attempt."""
        probe = min(2.0, self.policy.attempt_s)
        outcomes, error = self.ranks.together(
            (lambda: self.client.health(retry=self.client.retry.within(probe)) and None) if self.ranks.lead else None)
        if outcomes[0].ok:
            return True
        self.ranks.raise_lasting(outcomes, error)
        self._decide(r, outcomes[0].error)
        return False

    def _decide(self, r: int, message: str) -> None:
        """Rank 0 decides when the group tries again (`outage.next_attempt`), or that it gives up."""
        decision = None
        if self.ranks.lead:
            self.state.last_error = message
            attempt = next_attempt(self.state, time.monotonic(), self.policy, self.budget_s)
            decision = {"action": attempt.action, "reason": attempt.reason, "delay_s": attempt.delay_s}
            if attempt.action != "give_up":
                log.warning("round %d: %s", r, attempt.reason)
        decision = self.ranks.broadcast_json(decision)
        if decision["action"] == "give_up":  # on every rank, the others naming rank 0 as the one that decided
            why = decision["reason"] if self.ranks.lead else f"rank 0 of this participant failed: {decision['reason']}"
            raise CoordinatorUnavailable(why, status=0, code="unavailable")
        self.state.retry_in(float(decision["delay_s"]))
