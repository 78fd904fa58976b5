"""`ConnectionBook`: a server's open connections by client address, so that no one address
can take them all (`ServerLimits.max_connections_per_address`, `max_connections`).

A new connection that would pass a cap makes room first: the oldest idle connection under
that cap (no request in progress: new, between requests, or with only part of a request's
head in) is closed. An idle connection costs its client nothing to reopen, and a flood of
them from one address then only churns that address's own. The cap of an address is only
refused when every connection it holds is in a request; the global one then answers 503
(`readinto._over_capacity`). Used from the event loop's thread only.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from fedtrain.transport.server_limits import ServerLimits

log = logging.getLogger("fedtrain.coordinator")


class Reclaimable(Protocol):
    """A connection the book may close to make room for another (it is idle)."""

    def reclaim(self) -> None: ...


class ConnectionBook:
    """The connections of one server: by client address, and the idle ones oldest first."""

    def __init__(self, limits: ServerLimits, reclaim_idle: bool = True) -> None:
        self.limits = limits
        self.reclaim_idle = reclaim_idle  # False: caps only (the stock protocol cannot tell idle)
        self._address: dict[Reclaimable, str | None] = {}
        self._count: Counter[str | None] = Counter()
        self._idle: OrderedDict[Reclaimable, None] = OrderedDict()  # oldest idle first
        self.reclaimed = 0  # idle connections closed to make room, since the start
        self.refused = 0  # connections refused at an address's cap, since the start

    def admit(self, conn: Reclaimable, address: str | None) -> bool:
        """Take a new connection from `address` (idle until `busy`), closing the oldest idle
        one of that address, or of all when the global cap is reached, to make room; False
        (not taken: the caller refuses it) when the address holds its cap, all in requests."""
        full = self._count[address] >= self.limits.max_connections_per_address
        if full and not self._make_room(lambda c: self._address[c] == address):
            self.refused += 1
            log.warning("refused a connection of %s: it holds %d, max_connections_per_address, all in requests",
                        address, self._count[address])
            return False
        if len(self._address) >= self.limits.max_connections:
            self._make_room(lambda c: True)  # none idle: its request is answered 503 (over capacity)
        self._address[conn] = address
        self._count[address] += 1
        self._idle[conn] = None
        return True

    def idle(self, conn: Reclaimable) -> None:
        """`conn` has no request in progress from now: the newest idle one."""
        if conn in self._address:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def busy(self, conn: Reclaimable) -> None:
        """A request of `conn` is in progress: it is not closed to make room."""
        self._idle.pop(conn, None)

    def gone(self, conn: Reclaimable) -> None:
        """`conn` closed."""
        self._idle.pop(conn, None)
        if conn not in self._address:
            return
        address = self._address.pop(conn)
        self._count[address] -= 1
        if self._count[address] <= 0:
            del self._count[address]

    def _make_room(self, which: Callable[[Reclaimable], bool]) -> bool:
        """Close the oldest idle connection that `which` picks; whether there was one."""
        if not self.reclaim_idle:
            return False
        for conn in self._idle:
            if which(conn):
                address = self._address.get(conn)
                self.gone(conn)
                self.reclaimed += 1
                log.info("closed an idle connection of %s to make room for a new one", address)
                conn.reclaim()
                return True
        return False

    def count(self, address: str | None = None) -> int:
        """Connections open: all, or those of `address`."""
        return len(self._address) if address is None else self._count.get(address, 0)


def client_address(transport: Any) -> str | None:
    """The client's host (IP address) of a transport; None when it has none (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return None
