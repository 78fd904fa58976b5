"""The run's events and change notifications: what happened, stored and streamed.

`Events` owns the event log's writes (the store's `events` table), the broadcaster that
streams events, metrics and status changes to the dashboard (`broadcast.py`), and the one
`asyncio.Event` that long-polls wait on. Everything here runs on the event loop: a worker
thread reports through its owner, never here directly.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from typing import Any

from fedtrain.coordinator.state.broadcast import Broadcaster
from fedtrain.coordinator.state.storage import storage_full
from fedtrain.coordinator.state.store import Store

log = logging.getLogger("fedtrain.coordinator")


class Events:
    """Records events (log, store, stream) and wakes whoever waits for a change."""

    def __init__(self, broadcast: Broadcaster | None = None) -> None:
        self.broadcast = broadcast or Broadcaster()
        self._store: Store | None = None
        self._changed: asyncio.Event | None = None  # made on the event loop, by `start`
        self._stopping = False

    def attach(self, store: Store) -> None:
        """The store events are written to (opened after this object is made)."""
        self._store = store

    def start(self) -> None:
        """On the event loop: from now on changes wake waiters and go out on the stream."""
        self._changed = asyncio.Event()
        self._stopping = False

    def record(self, kind: str, message: str, pid: str | None = None) -> None:
        """Log, store and stream one event. A full disk does not stop what reports it (a
        roll back, say): the event is then only logged."""
        log.info("%s: %s", kind, message)
        if self._store is not None:
            try:
                self._store.add_event(kind, message, pid)
            except sqlite3.Error as e:
                if not storage_full(e):
                    raise
                log.warning("event not stored (%s): %s: %s", e, kind, message)
        if self._changed is not None:
            self.broadcast.publish("event", {"ts": time.time(), "kind": kind, "participant_id": pid,
                                             "message": message})

    def publish(self, kind: str, data: Any) -> None:
        """Stream a message that is not an event (config, metrics) to the dashboard."""
        self.broadcast.publish(kind, data)

    def notify(self) -> None:
        """The run's state changed: wake every waiter, and stream the new status."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()
            self.broadcast.publish("status", None)

    async def wait_changed(self, timeout: float) -> bool:
        """Wait for the next `notify` for at most `timeout` seconds; False when none came
        (or the events have not started)."""
        changed = self._changed
        if changed is None or timeout <= 0 or self._stopping:
            return False
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def stop_waiting(self) -> None:
        """The server is stopping: every long poll answers now, and no new one waits; every
        stream ends. Without this a stop would wait for each open long poll (up to 60 s)."""
        self._stopping = True
        if self._changed is not None:
            self._changed.set()
        self.broadcast.close_all()

    def close(self) -> None:
        self.broadcast.close_all()
