"""What a joined participant keeps up in the background: heartbeats, and the run's event stream.

`Presence` owns two daemon threads, each with its own clone of the client and a short retry
policy, so that a slow coordinator never holds them up and no policy is shared:

- the heartbeat thread sends, every `interval_s()` seconds, the stats the participant's
  `stats()` returns (step, round, loss, tokens/s, config version);
- the event thread follows `GET /v1/stream` (reconnecting with a backoff), notes the newest
  config version announced (applied by the participant at its next round boundary) and
  keeps the recent run events.

The participant reads `latest_config_version` and `events` and tells of versions it learnt
itself through `note_config_version`; only this class writes them, under its lock.
`TokenRate` is the tokens-per-second figure the heartbeats carry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fedtrain.errors import CoordinatorError
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.retry import RetryPolicy

__all__ = ["Presence", "TokenRate"]

log = logging.getLogger("fedtrain.participant")

_BACKGROUND_RETRY = RetryPolicy(max_elapsed_s=1.0)  # a missed heartbeat is sent again at the next beat
_KEPT_EVENTS = 100


class Presence:
    """Heartbeats and the event stream of participant `pid`, once `start`ed."""

    def __init__(self, client: CoordinatorClient, *, interval_s: Callable[[], float],
                 stats: Callable[[], dict[str, Any]]) -> None:
        self.client = client
        self.interval_s = interval_s
        self.stats = stats
        self._pid = ""
        self._lock = threading.Lock()
        self._latest_config_version = 0
        self._events: list[tuple[str, Any]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def latest_config_version(self) -> int:
        """The newest config version this participant has heard of (it may not be in force yet)."""
        return self._latest_config_version

    @property
    def events(self) -> list[tuple[str, Any]]:
        """The recent config changes and run events of the stream, oldest first: (kind, data)."""
        return list(self._events)

    def note_config_version(self, version: int) -> None:
        with self._lock:
            self._latest_config_version = max(self._latest_config_version, version)

    def start(self, pid: str) -> None:
        self._pid = pid
        self._threads = [
            threading.Thread(target=self._heartbeats, name="fedtrain-heartbeat", daemon=True),
            threading.Thread(target=self._listen, name="fedtrain-events", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both threads; waits up to `timeout_s` for the heartbeat thread (the event thread
        notices at its next event or reconnect)."""
        self._stop.set()
        if self._threads:
            self._threads[0].join(timeout=timeout_s)

    def _heartbeats(self) -> None:
        client = self.client.clone(retry=_BACKGROUND_RETRY)
        try:
            while not self._stop.wait(self.interval_s()):
                try:
                    client.heartbeat(self._pid, **self.stats())
                except CoordinatorError as e:
                    log.debug("heartbeat failed: %s", e.message)
        finally:
            client.close()

    def _listen(self) -> None:
        client = self.client.clone(retry=_BACKGROUND_RETRY)
        backoff = 0.5
        try:
            while not self._stop.is_set():
                try:
                    for kind, data in client.events(stop=self._stop.is_set):
                        backoff = 0.5
                        if kind == "config_change":
                            self.note_config_version(int(data["version"]))
                        if kind in ("config_change", "event"):
                            with self._lock:
                                self._events = [*self._events[-(_KEPT_EVENTS - 1):], (kind, data)]
                except Exception as e:  # noqa: BLE001 - the stream is a convenience: log, back off, reconnect
                    log.debug("event stream interrupted: %s", e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        finally:
            client.close()


class TokenRate:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._events.append((now, n))
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.pop(0)

    def per_second(self) -> float | None:
        if len(self._events) < 2:
            return None
        span = self._events[-1][0] - self._events[0][0]
        return sum(n for _, n in self._events[1:]) / span if span > 0 else None
