"""What the parts of `Coordinator` share: the run's state, and the helpers they all call.

`Coordinator` (`service.py`) is put together from parts, a mixin each: participants,
the live config, uploads and rounds. Each part derives from `CoordinatorBase`, which
declares the state that `Coordinator.__init__` and `open()` set (so that every part is
type-checked against it) and holds what every part uses: events and notifications, and
the checks of who may act (`_participant`, `_require_admin`). `Refused` is the answer to
a request the coordinator turns down; `app.py` turns it into the one JSON error shape.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity, Tokens
from fedtrain.coordinator.broadcast import Broadcaster
from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.publish import Published, WeightsGuard
from fedtrain.coordinator.spool import RoundSpool
from fedtrain.coordinator.storage import storage_full
from fedtrain.coordinator.store import ParticipantRow, Store
from fedtrain.errors import FedtrainError
from fedtrain.merge import OuterOptimizer, RunningSum
from fedtrain.wire import EncodedBody

if TYPE_CHECKING:
    from fedtrain.coordinator.receive import SpoolFiles, Staging
    from fedtrain.coordinator.uploads import _Direct

log = logging.getLogger("fedtrain.coordinator")


class Refused(FedtrainError):
    """A request the coordinator refuses, with the HTTP status and code to answer with."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        self.status = status
        self.code = code


@dataclass
class Live:
    """What a participant last told us; kept in memory only."""

    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    round: int = 0
    config_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class CoordinatorBase:
    """The state and the common helpers of every part of the coordinator."""

    # Set by Coordinator.__init__.
    config_path: Path | None
    broadcast: Broadcaster
    tokens: Tokens
    clock: Callable[[], float]
    _fold_lock: threading.Lock
    _folds: int
    _direct: _Direct | None  # an upload being written straight into the running sum
    _deferred_folds: set[asyncio.Task[None]]  # folds waiting for the direct upload (uploads.py)
    _fold_failure: str | None  # a deferred fold failed: the open round cannot be merged
    _changed: asyncio.Event | None
    _close_task: asyncio.Task | None
    _commit_task: asyncio.Task | None
    _published: Published | None
    _weights: WeightsGuard
    _rollbacks: int
    _janitor: ThreadPoolExecutor
    bytes_in: int
    bytes_out: int
    storage_full_since: float | None  # when a full disk began to hold the run back (uploads get 507)
    # Set by Coordinator.open().
    store: Store
    ckpt: CheckpointDir
    spool: Path
    _spool_files: SpoolFiles
    config: RunConfig
    config_version: int
    latest_config_version: int
    outer: OuterOptimizer
    version: int
    committed_version: int
    spec: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    acc: RunningSum
    _staging: Staging
    participants: dict[str, ParticipantRow]
    live: dict[str, Live]
    submitted: dict[str, int]
    opened_at: float
    closing: bool
    reason: str
    round_spool: RoundSpool
    late: dict[str, int]
    _round_times: list[float]
    _rejected: dict[str, str]
    submit_times: deque[list[float]]

    if TYPE_CHECKING:  # defined by one part, called by others

        def _maybe_close(self) -> None:  # rounds.py
            ...

        def _enter_round(self) -> None:  # live_config.py
            ...

        def _abort_direct(self, pid: str | None = None) -> None:  # uploads.py
            ...

    @property
    def finished(self) -> bool:
        return policy.run_finished(self.version, self.config)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()
            self.broadcast.publish("status", None)

    def _event(self, kind: str, message: str, pid: str | None = None) -> None:
        log.info("%s: %s", kind, message)
        try:
            self.store.add_event(kind, message, pid)
        except sqlite3.Error as e:  # a full disk must not stop what reports it (a roll back, say)
            if not storage_full(e):
                raise
            log.warning("event not stored (%s): %s: %s", e, kind, message)
        if self._changed is not None:
            self.broadcast.publish("event", {"ts": time.time(), "kind": kind, "participant_id": pid,
                                             "message": message})

    def _participant(self, ident: Identity, pid: str) -> ParticipantRow:
        p = self.participants.get(pid)
        if p is None:
            raise Refused(404, "unknown_participant", f"participant {pid!r} is not part of this run; join first")
        if p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(403, "forbidden", f"participant {pid!r} joined with a different token")
        if p.state == policy.EVICTED and not ident.is_admin:
            raise Refused(403, "evicted", f"participant {pid!r} was evicted from this run by an admin")
        return p

    def _write_checkpoint(self, version: int, outer: OuterOptimizer, body: EncodedBody) -> str:
        """Both files of `version`: the model file holds `body` (the weights of `outer`, as
        served: same metadata and digest algorithm, and its digest is not computed again when
        known), the other `outer`'s state. Returns the model file's digest. Tensors that could
        not go to the disk straight from memory are then moved to where they can (`checkpoints`)."""
        written = self.ckpt.write(
            version, outer.params, outer.state_tensors(), outer.state_metadata(), body.metadata,
            body.digest_algorithm, digest=body.known_digest,
        )
        # Only the optimizer in force is moved: one replaced meanwhile by a config change may
        # share its state with the new one (`live_config`), which its move would destroy. The
        # fold lock keeps such a change from coming in during the move.
        if written.misfits or written.state_misfits:
            with self._fold_lock, self._weights.lock:
                if outer is self.outer:
                    self.ckpt.realign(outer, written)
        return written.digest

    def _require_admin(self, ident: Identity, what: str) -> None:
        if not ident.is_admin:
            raise Refused(403, "admin_only", f"{what} needs the admin token")
