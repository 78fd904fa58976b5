"""The progress of one long transfer: bytes done of the total, the rate, the time left.

Both ends keep one per transfer: the participant logs a line every few seconds while it
uploads or downloads, and the coordinator shows the transfers in flight in its status
(`view()`, the same shape either way). One writer calls `add`; any thread may read.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

#: The rate is measured over the last this many seconds, so that a link that slows down or
#: stalls shows in it soon (and the ETA with it).
RATE_WINDOW_S = 5.0
#: How often a transfer logs its progress line, once it has run this long.
LOG_EVERY_S = 5.0


class Progress:
    """`what` ("upload of round 5", ...) moving `total` bytes (None: not known yet)."""

    def __init__(self, what: str, total: int | None, *, log: logging.Logger | None = None,
                 every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self._log = log
        self._every_s = every_s
        self._clock = clock
        self.started = clock()
        self._logged = self.started
        self._samples: deque[tuple[float, int]] = deque([(self.started, 0)])

    def add(self, n: int) -> None:
        """`n` more bytes moved; logs a progress line every `every_s` seconds."""
        self.done += n
        now = self._clock()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()
        if self._log is not None and now - self._logged >= self._every_s:
            self._logged = now
            self._log.info("%s", self.line())

    def rate(self) -> float:
        """Bytes per second over the last RATE_WINDOW_S seconds (0 before any time has passed)."""
        (t0, b0), (t1, b1) = self._samples[0], (self._clock(), self.done)
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds until the total is moved at the current rate (None: total or rate unknown)."""
        rate = self.rate()
        if self.total is None or rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / rate)

    def view(self) -> dict[str, object]:
        """As a status shows it: what, bytes done and total, rate (bytes/s), ETA (s), elapsed (s)."""
        eta = self.eta_s()
        return {"what": self.what, "bytes": self.done, "total": self.total, "rate_bps": round(self.rate(), 1),
                "eta_s": None if eta is None else round(eta, 1),
                "elapsed_s": round(self._clock() - self.started, 1)}

    def line(self) -> str:
        """One log line: "upload of round 5: 48.2 of 100.7 MB (48%), 11.9 MB/s, 4 s left"."""
        done = f"{self.done / 1e6:,.1f}"
        if self.total:
            done += f" of {self.total / 1e6:,.1f} MB ({100 * self.done // self.total}%)"
        else:
            done += " MB"
        eta = self.eta_s()
        left = "" if eta is None else f", {eta:,.0f} s left"
        return f"{self.what}: {done}, {self.rate() / 1e6:,.1f} MB/s{left}"
