"""Going back: to the last committed round after a merge or commit failed (`roll_back`), or
to a kept version at an admin's word (`roll_back_to`), waiting for room on a full disk to do it.

`GoingBack` owns the count of roll backs and the time a full disk began to hold the run back;
`Rounds` (`progress.py`) calls it and hands it the moves of its own it needs (`RoundMoves`).

More: docs/architecture.md, "coordinator/rounds/going_back.py".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.rounds.open_round import OpenRound
from fedtrain.coordinator.state import storage
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.storage import storage_full
from fedtrain.errors import Refused

log = logging.getLogger("fedtrain.coordinator")

#: How long an admin's roll back waits for a round that is closing when it comes.
ROLL_BACK_WAIT_S = 30.0


@dataclass(frozen=True)
class RoundMoves:
    """What going back needs of `Rounds`: open a round (`end_round(version, now, committed)`),
    wait for the background commit (`settle_commit`: False if the run went back meanwhile),
    bring the newest config into force (`enter_round`), a new version's privacy record."""

    end_round: Callable[[int, float | None, bool], None]
    settle_commit: Callable[[], Awaitable[bool]]
    enter_round: Callable[[], None]
    privacy_meta: Callable[[], dict[str, str] | None]


class GoingBack:
    """The run's moves back to a committed version."""

    def __init__(self, open_round: OpenRound, configs: ConfigVersions, intake: Intake, committer: Committer,
                 events: Events, clock: Callable[[], float], moves: RoundMoves) -> None:
        self._open = open_round
        self._configs = configs
        self._intake = intake
        self._committer = committer
        self._events = events
        self._clock = clock
        self._moves = moves
        self.count = 0  # roll backs since this coordinator started
        self.storage_full_since: float | None = None  # when a full disk began to hold the run back (uploads get 507)

    async def roll_back(self, why: str, kind: str) -> None:
        """Back to the last committed round: its weights and optimizer state, no uploads."""
        committed = self._committer.committed_version
        self._events.record(kind, f"{why}; reloading the last committed round {committed}, uploads must be sent again")
        self._open.version = committed
        self._committer.serve(None)
        self.count += 1
        await self._reload_when_there_is_room()
        self._moves.end_round(committed, None, False)
        self._open.closing = False
        self._events.notify()

    def _reload(self, version: int, keep: int) -> None:
        """Worker thread: the committed version's weights and state in force, the sum empty."""
        with self._intake.fold_lock:
            self._committer.reload(version, keep)
            self._intake.sum.reset()

    async def _reload_when_there_is_room(self) -> None:
        """Reload the last committed round; while the disk is full (its database writes fail),
        wait and try again, answering uploads 507 meanwhile (`storage_full_since`), so the run
        goes on by itself once there is room. Any other failure is raised as before."""
        delay = 0.5
        while True:
            try:
                await asyncio.to_thread(self._reload, self._open.version, self._configs.config.keep_checkpoints)
            except Exception as e:
                if not storage_full(e):
                    raise
                if self.storage_full_since is None:
                    self.storage_full_since = self._clock()
                    log.warning("going back to round %d waits for room on the disk: %s", self._open.version, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, storage.RETRY_AFTER_S)
                continue
            if self.storage_full_since is not None:
                waited = self._clock() - self.storage_full_since
                self._events.record("storage", f"room on the disk again after {waited:.0f}s: back at round "
                                               f"{self._open.version}, uploads are taken again")
                self.storage_full_since = None
            return

    async def roll_back_to(self, version: int, who: str) -> dict[str, Any]:
        """Put kept `version`'s weights and optimizer state back in force: the open round r
        closes with no updates (uploads sent for it are dropped; their senders find it closed
        and fetch the new model) and version r + 1 is committed with the kept version's
        state, durably, before this returns (`restore.py`). A round closing when it comes is
        let finish first (up to `ROLL_BACK_WAIT_S`; then 409 `round_closing`)."""
        self._check_kept(version)
        deadline = time.monotonic() + ROLL_BACK_WAIT_S
        while self._open.closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Refused(409, "round_closing", f"round {self._open.version} is still closing after "
                              f"{ROLL_BACK_WAIT_S:g}s; try again in a moment")
            if not await self._events.wait_changed(min(remaining, 1.0)):
                await asyncio.sleep(0.05)  # (no notifications before start: look again shortly)
        self._check_kept(version)  # a commit meanwhile may have pruned it
        self._open.closing = True  # admit no upload while going back
        self._intake.abort_direct()
        try:
            await self._moves.settle_commit()
            await self._intake.idle()
            r = self._open.version
            reason = f"rolled back to version {version} by {who}"
            self._committer.serve(None)  # version r + 1 is served from its file
            await asyncio.to_thread(self._restore, r, version, reason)
        finally:
            self._open.closing = False
        self._committer.committed(r + 1)
        self._moves.end_round(r + 1, self._clock(), False)
        self._moves.enter_round()
        self._open.reason = "round opened"
        self._events.record("rollback", f"{reason}: round {r} closed with no updates, version {r + 1} holds the "
                                        f"weights of version {version}")
        self._events.notify()
        return {"version": r + 1, "restored": version}

    def _check_kept(self, version: int) -> None:
        kept = self._committer.kept_versions()
        if version not in kept:
            raise Refused(404, "version_not_kept", f"version {version} is not a kept checkpoint; kept: "
                                                   f"{', '.join(map(str, kept)) or 'none'}")

    def _restore(self, r: int, version: int, reason: str) -> None:
        """Worker thread: kept `version` in force, committed again as version r + 1."""
        cfg = self._configs.config
        with self._intake.fold_lock:
            self._committer.restore(version)
            self._intake.sum.reset()
            self._committer.reconfigure(cfg, locked=True)  # the config in force may name another algorithm
        # Outside the fold lock, which the checkpoint writer takes itself; no fold runs (closing).
        self._committer.commit_restored(r, self._committer.model, reason, cfg, self._open.opened_at,
                                        self._moves.privacy_meta())
