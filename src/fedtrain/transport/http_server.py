"""Which HTTP protocol uvicorn serves the coordinator with: the fast one (`ReadIntoProtocol`,
held to `ServerLimits`) when fast IO is on and the installed uvicorn and httptools are in
their tested range (`versions.py`); else uvicorn's stock httptools protocol, the plain path,
held to the cap per client address only (`stock_protocol`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fedtrain.transport import versions
from fedtrain.transport.connections import ConnectionBook, client_address
from fedtrain.transport.server_limits import ServerLimits
from fedtrain.transport.setting import fast_io_enabled

STOCK = "httptools"
"""uvicorn's name for its stock httptools protocol."""


def fast_protocol(limits: ServerLimits, fast_io: bool | None = None) -> Callable[..., Any] | None:
    """A factory of the fast protocol held to `limits`, for `uvicorn.Config(http=...)`; None
    when the plain path serves: fast IO off (`fast_io`, else `FEDTRAIN_FAST_IO`), or uvicorn or
    httptools outside their tested range (then with a warning, once). Its connections share
    one `ConnectionBook` (one per call: per server)."""
    if not fast_io_enabled(fast_io) or versions.outside_tested("uvicorn", "httptools"):
        return None
    from fedtrain.transport.readinto import ReadIntoProtocol

    # A BufferedProtocol, which uvicorn only constructs: with our limits.
    return functools.partial(ReadIntoProtocol, limits=limits, book=ConnectionBook(limits))


def stock_protocol(limits: ServerLimits) -> Callable[..., Any]:
    """A factory of uvicorn's stock httptools protocol (the plain path) held to
    `limits.max_connections_per_address`: a connection beyond it is closed at once. It touches
    only asyncio's side of the protocol (`connection_made`, `connection_lost`), so no idle
    connection is told apart or reclaimed, and uvicorn's own limit (`limit_concurrency`)
    answers beyond `max_connections`."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class CappedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not book.admit(self, client_address(transport)):
                transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            book.gone(self)
            super().connection_lost(exc)

        def reclaim(self) -> None:  # never called: the book does not reclaim here
            self.transport.close()

    book = ConnectionBook(limits, reclaim_idle=False)
    return CappedProtocol
