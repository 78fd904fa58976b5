"""The model downloads in flight, per participant: bytes sent of the total, rate and ETA
(`transport.progress.Progress`), for the status (`participants[i]["transfers"]`).

The connections of one body for one participant (a download resumed, or its byte ranges over
parallel connections) count as one transfer: its total is the sum of their ranges. Threads:
the event loop begins and ends a transfer; the send pool's threads add bytes to it (under the
lock, several connections may add at once); the status reads it on the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fedtrain.config.sections import MAX_STREAMS
from fedtrain.errors import Refused
from fedtrain.transport.progress import Progress

__all__ = ["MAX_DOWNLOAD_CONNECTIONS", "DownloadsInFlight", "Tracked"]

#: The model downloads one participant may have in flight at once, over all its connections:
#: twice the most parallel streams a run allows (`transfer.streams`), so that the connections
#: of a broken download that the coordinator has not seen go yet leave room for their retries.
MAX_DOWNLOAD_CONNECTIONS = 2 * MAX_STREAMS
#: Versions whose downloaded bytes are kept for the status's recent rounds.
KEPT_VERSIONS = 64


class Tracked:
    """One connection's share of a transfer: `add` its bytes as they go, `end` it once. `book`
    and `key`: the transfer in flight it adds to (None: not shown, an admin's); `counted` hears
    of the bytes it sent in all when it ends (a participant's bytes_down: what it was sent, not
    what it asked for, so a download cut and resumed counts once)."""

    def __init__(self, book: DownloadsInFlight | None, key: tuple[str, str] | None,
                 counted: Callable[[int], None] | None = None) -> None:
        self._book, self._key, self._counted, self._ended = book, key, counted, False
        self.sent = 0

    def add(self, n: int) -> None:
        self.sent += n
        if self._book is not None and self._key is not None:
            self._book._add(self._key, n)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._book is not None and self._key is not None:
            self._book._end(self._key)
        if self._counted is not None:
            self._counted(self.sent)


class DownloadsInFlight:
    """The downloads in flight, by (participant, body ETag); and the bytes participants were
    sent of each of the newest KEPT_VERSIONS versions (since this coordinator started)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._progress: dict[tuple[str, str], Progress] = {}
        self._connections: dict[tuple[str, str], int] = {}
        self._by_version: dict[int, tuple[int, int]] = {}  # (bytes sent, as the whole fp32 model)

    def sent_of(self, version: int, sent: int, fp32: int | None = None) -> None:
        """`sent` more bytes of version `version` went to a participant (`fp32`: what they stand
        for in bytes of the whole model, for a compressed delta; None: `sent`, a whole model's);
        the newest KEPT_VERSIONS versions are kept (a run's status shows its recent rounds)."""
        with self._lock:
            was, was_fp32 = self._by_version.get(version, (0, 0))
            self._by_version[version] = (was + sent, was_fp32 + (sent if fp32 is None else fp32))
            while len(self._by_version) > KEPT_VERSIONS:
                del self._by_version[min(self._by_version)]

    def version_bytes(self, version: int) -> int | None:
        """The bytes participants were sent of `version` (None: none since this coordinator started)."""
        with self._lock:
            got = self._by_version.get(version)
            return None if got is None else got[0]

    def version_fp32_bytes(self, version: int) -> int | None:
        """What the bytes sent of `version` would have been as whole fp32 models (None: none sent)."""
        with self._lock:
            got = self._by_version.get(version)
            return None if got is None else got[1]

    def begin(self, pid: str, etag: str, what: str, nbytes: int,
              counted: Callable[[int], None] | None = None) -> Tracked:
        """A connection of participant `pid` begins sending `nbytes` of the body named `etag`; a
        429 when `pid` has MAX_DOWNLOAD_CONNECTIONS in flight (the limit counts per participant,
        not per connection or per address)."""
        key = (pid, etag)
        with self._lock:
            held = sum(n for (p, _), n in self._connections.items() if p == pid)
            if held >= MAX_DOWNLOAD_CONNECTIONS:
                raise Refused(429, "too_many_downloads", f"{pid} has {held} model downloads in flight, the most "
                              "one participant may; ask again once one is over", {"retry_after_s": 1.0})
            progress = self._progress.get(key)
            if progress is None:
                self._progress[key] = Progress(what, nbytes, clock=self._clock)
            else:
                progress.total = (progress.total or 0) + nbytes
            self._connections[key] = self._connections.get(key, 0) + 1
        return Tracked(self, key, counted)

    def _add(self, key: tuple[str, str], n: int) -> None:
        with self._lock:
            progress = self._progress.get(key)
            if progress is not None:
                progress.add(n)

    def _end(self, key: tuple[str, str]) -> None:
        with self._lock:
            left = self._connections.get(key, 1) - 1
            if left > 0:
                self._connections[key] = left
            else:
                self._connections.pop(key, None)
                self._progress.pop(key, None)

    def views(self, pid: str) -> list[dict[str, Any]]:
        """The transfers in flight to `pid`, as the status shows them (`direction` "down",
        `connections`: how many carry it now)."""
        with self._lock:
            return [{**p.view(), "direction": "down", "connections": self._connections.get(k, 0)}
                    for k, p in self._progress.items() if k[0] == pid]

    def add_to(self, participants: list[dict[str, Any]]) -> None:
        """Give each participant of a status its `transfers` in flight: an upload the intake
        shows under `transfer` (if any) and the downloads here."""
        for row in participants:
            up = row.get("transfer")
            row["transfers"] = ([up] if isinstance(up, dict) else []) + self.views(str(row.get("id")))
