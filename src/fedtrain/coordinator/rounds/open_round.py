"""The open round: its number, its clock, and the updates it has taken.

`OpenRound` owns the round in progress: its number, when it opened, whether it is closing
and why, the updates reserved into it with their staleness, and recent submission times.
Plain state; the event loop only.

More: docs/architecture.md, "coordinator/rounds/open_round.py".
"""

from __future__ import annotations

from collections import deque

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.policy import async_rules


class OpenRound:
    """The round in progress."""

    def __init__(self, version: int, now: float, recent_submit_times: list[list[float]]) -> None:
        self.version = version
        self.opened_at = now
        self.closing = False
        self.reason = "round opened"
        self.submitted: dict[str, int] = {}  # participant -> tokens counted, reserved as its body was verified
        self.late: dict[str, int] = {}  # "pid@lateR" -> tokens, folded into the open round
        self.staleness: dict[str, int] = {}  # asynchronous mode: participant -> versions its update is behind
        self._times: list[float] = []  # seconds after the round opened of each submission
        self.submit_times: deque[list[float]] = deque(recent_submit_times, maxlen=100)

    def view(self, deadline_s: float) -> policy.RoundView:
        return policy.RoundView(self.version, self.opened_at, frozenset(self.submitted), deadline_s)

    def deadline(self, cfg: RunConfig) -> tuple[float, str]:
        """The deadline in seconds after the round opened, and why (fixed or adaptive)."""
        return policy.adaptive_deadline(self.submit_times, cfg)

    def admission(self, round_: int, finished: bool, cfg: RunConfig) -> policy.Admission:
        if cfg.schedule.mode == "async":
            return async_rules.admit(round_, self.version, self.closing, finished, cfg)
        return policy.admit_upload(round_, self.version, self.closing, finished, cfg)

    @property
    def occupied(self) -> bool:
        """Whether the round holds an update or is closing (asynchronous mode: no seat is free)."""
        return self.closing or bool(self.submitted) or bool(self.late)

    @staticmethod
    def key(pid: str, round_: int, admission: policy.Admission) -> str:
        """An upload's key: its participant, or `pid@lateR` for a late fold of round R."""
        return pid if admission.action == "accept" else f"{pid}@late{round_}"

    def taken(self, key: str) -> bool:
        return key in self.submitted or key in self.late

    def reserve(self, key: str, tokens: int, late: bool, staleness: int | None = None) -> None:
        (self.late if late else self.submitted)[key] = tokens
        if staleness is not None:
            self.staleness[key] = staleness

    def release(self, key: str) -> None:
        self.submitted.pop(key, None)
        self.late.pop(key, None)
        self.staleness.pop(key, None)

    def note_submission(self, now: float) -> None:
        self._times.append(max(0.0, now - self.opened_at))

    def may_reach(self, active: set[str]) -> int:
        """How many updates the round may end with: those in or on their way, plus one per
        active participant yet to send one (`policy.to_fold`)."""
        return len(set(self.submitted) | set(self.late)) + len(active - set(self.submitted))

    def next(self, version: int, now: float | None, committed: bool) -> None:
        """Round `version` is the open one, with no update yet: after a commit (`committed`:
        its submission times count for the deadline) or going back; opened at `now` (None:
        the clock goes on from when the round it replaces opened)."""
        if committed:
            self.submit_times.append(self._times)
        self.version = version
        self._times = []
        self.submitted = {}
        self.late = {}
        self.staleness = {}
        if now is not None:
            self.opened_at = now
