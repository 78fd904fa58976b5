"""`ServerLimits`: what one connection may hold of the coordinator, and for how long.

The fast protocol (`readinto.ReadIntoProtocol`) enforces them all; with the stock protocol
(fast IO off) only uvicorn's keep-alive timeout and concurrency limit, set from them in
`server.uvicorn_config`, and the cap per client address (`http_server.stock_protocol`) hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one connection may hold of the coordinator, and for how long (`ReadIntoProtocol`
    enforces them all; with the stock protocol only uvicorn's keep-alive and concurrency limits hold)."""

    send_timeout_s: float = 60.0
    """A response: the longest its client may go without taking a byte; then the connection is closed."""
    body_timeout_s: float = 60.0
    """A request body: the longest its client may stay silent while the app waits for bytes; then closed."""
    idle_timeout_s: float = 30.0
    """A connection without a request in progress (new, or between requests): the head of its next
    request must be in within this, else it is closed."""
    max_connections: int = 1000
    """Open connections at most. A new one beyond them first closes the oldest idle one (no request in
    progress); when none is idle, its request is answered 503 and the connection closed."""
    max_connections_per_address: int = 256
    """Open connections of one client address at most. A new one beyond them first closes that address's
    oldest idle one; when none is idle, it is refused (answered 503 and closed)."""
    drop_limit_bytes: int = 64 << 20
    """Body bytes left unread once the answer is out: read and dropped if at most this many (so that a
    client sending its body whole reads the answer), else the connection is closed."""

    def __post_init__(self) -> None:
        for name in ("send_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name} must be a positive number of seconds, not {value!r}")
        if self.max_connections < 1 or self.max_connections_per_address < 1 or self.drop_limit_bytes < 0:
            raise ValueError("ServerLimits: max_connections and max_connections_per_address must be at least 1, "
                             f"drop_limit_bytes at least 0: {self}")
