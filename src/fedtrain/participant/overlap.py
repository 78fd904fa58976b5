"""Overlapped sync: training goes on while the round's upload, merge and download happen.

At the H-th step the participant sends Δ = θ_round − θ_sent and keeps training at once; a
worker thread runs the `SyncEngine`'s exchange (upload, wait for the round to close,
download θ_{r+1} into the snapshot). When that is done (checked at every step, waited for
at the next sync point at the latest) the weights become θ_{r+1} + (θ − θ_sent): the new
global model plus the local progress made meanwhile — the one-round-delayed outer update of
overlapped DiLoCo. θ_{r+1} is the reference of the next Δ, which therefore carries all
local progress since the send. Extra memory: one copy of the sync set (θ_sent).

`OverlappedSync` owns the worker thread and the exchange in flight, and nothing of the
participant's: the participant hands it a round to send and takes back what `finish`
returns. Only the worker talks to the coordinator while an exchange is pending (heartbeats
have their own client); everything that touches the model runs on the training thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorError
from fedtrain.participant.outage import is_transient
from fedtrain.participant.sync import SyncEngine

__all__ = ["Landed", "OverlappedSync"]

log = logging.getLogger("fedtrain.participant")


@dataclass(frozen=True)
class Landed:
    """An overlapped exchange that has finished: the round sent, the global version now in
    the snapshot, and the caller's record of that round as `start` was given it."""

    round: int
    version: int
    record: dict[str, Any]
    sent: dict[str, torch.Tensor]


@dataclass
class _Pending:
    future: Future[int]
    sent: dict[str, torch.Tensor]
    record: dict[str, Any]
    round: int


class OverlappedSync:
    """The background half of a participant's sync, over its `SyncEngine`."""

    def __init__(self, engine: SyncEngine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedtrain-sync")
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        """Whether an exchange has been started and not finished yet."""
        return self._pending is not None

    @property
    def ready(self) -> bool:
        """Whether a pending exchange is done, so that `finish` returns at once."""
        return self._pending is not None and self._pending.future.done()

    def start(self, r: int, pid: str, config: RunConfig, *, tokens: int, record: dict[str, Any]) -> None:
        """Take this round's Δ and send it on the worker thread; returns at once. `record`
        comes back with the result (see `finish`). Call only when nothing is pending."""
        if self._pending is not None:
            raise RuntimeError("an overlapped exchange is still pending: finish it first")
        sent = self.engine.copy_sync_set()
        self.engine.take_delta(sent)
        body = self.engine.encode(config)
        future = self._pool.submit(self.engine.exchange, r, pid, body, config, tokens=tokens)
        self._pending = _Pending(future, sent, record, r)

    def finish(self) -> Landed | None:
        """Wait for the pending exchange. None when it failed transiently: that round's
        contribution is lost, and the next Δ is measured from the weights sent (the local
        progress is kept). Other failures are raised."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("no overlapped exchange is pending")
        self._pending = None
        try:
            version = pending.future.result()
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            log.warning("overlapped sync of round %d failed (%s); continuing from local weights", pending.round,
                        e.message)
            self.engine.restore(pending.sent)
            return None
        return Landed(pending.round, version, pending.record, pending.sent)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a pending exchange is done (without applying it) or `timeout_s` has
        passed; True when nothing is left running."""
        pending = self._pending
        if pending is None:
            return True
        try:
            pending.future.exception(timeout=timeout_s)  # its failure is for `finish` to raise
        except concurrent.futures.TimeoutError:  # (the builtin TimeoutError from Python 3.11 on)
            return False
        return True

    def close(self) -> None:
        """Stop the worker thread (the participant lands a pending exchange first)."""
        self._pool.shutdown(wait=False)
