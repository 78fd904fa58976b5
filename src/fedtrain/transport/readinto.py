"""`ReadIntoProtocol`: uvicorn's httptools protocol, reading an upload's body from the socket
straight into the caller's memory (the fast `BodySource`). The plain path beside it is uvicorn's
stock protocol. How it hooks uvicorn and what it pins: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from typing import Any

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from fedtrain.errors import error_body
from fedtrain.transport.connections import ConnectionBook, client_address
from fedtrain.transport.protocols import READINTO, SEND, Abandoned
from fedtrain.transport.send import SocketSink
from fedtrain.transport.server_limits import ServerLimits

__all__ = ["ReadIntoProtocol", "SocketBodySource"]

log = logging.getLogger("fedtrain.coordinator")

# The loop reads the socket into this buffer when no `readinto` waits: headers, small bodies.
BUFFER = 256 << 10
# A connection refused at its address's cap: the longest its request's head may take to come
# (then answered 503), so that refused connections do not pile up.
REFUSED_HEAD_S = 1.0

_local = threading.local()


def _read_buffer() -> memoryview:
    """This thread's buffer for socket reads no `readinto` waits for. One per event loop, not
    per connection: the loop hands it out (`get_buffer`) and gets it back filled
    (`buffer_updated`) with nothing in between, and the parser copies out what it keeps."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(bytearray(BUFFER))
    return buffer


class SocketBodySource:
    """One request's body, read from the socket into the caller's memory (the `READINTO`
    extension, a `BodySource`)."""

    def __init__(self, protocol: ReadIntoProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol, self._cycle = protocol, cycle

    async def readinto(self, view: memoryview) -> int:
        """Fill `view` with the next bytes of the body; fewer only at its end (0: no more)."""
        return await self._protocol.readinto(self._cycle, view)

    def abandon(self) -> None:
        """Stop a `readinto` in progress now: it raises `Abandoned`, and `view` is not written again."""
        self._protocol.abandon(self._cycle)

    def close(self) -> None:
        """Close the connection now, whatever it was doing (a newer attempt of the same upload
        took over from it): a `readinto` in progress raises ClientDisconnect, and the request's
        answer, if any, goes nowhere, quietly."""
        self._protocol.close_now(self._cycle)

    def allow_drop(self, nbytes: int) -> None:
        """Should the answer go out before the body was read, up to `nbytes` of it (more than
        `ServerLimits.drop_limit_bytes`) may be read and dropped before the connection goes on."""
        if self._cycle is self._protocol.http.cycle:
            self._protocol.http.drop_limit = max(self._protocol.http.drop_limit, nbytes)


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The answer on a connection beyond `ServerLimits.max_connections`."""
    await _answer_503(send, "over_capacity", "the coordinator has as many connections open as it takes; try again "
                      "shortly")


async def _over_address_cap(scope: Any, receive: Any, send: Any) -> None:
    """The answer on a connection beyond `ServerLimits.max_connections_per_address`."""
    await _answer_503(send, "too_many_connections", "this client address holds as many connections as the "
                      "coordinator takes from one address (max_connections_per_address), all in requests; "
                      "try again shortly")


async def _answer_503(send: Any, code: str, message: str) -> None:
    body = json.dumps(error_body(503, code, message)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class ReadIntoProtocol(asyncio.BufferedProtocol):
    """An HTTP/1.1 connection (uvicorn's `HttpToolsProtocol`) whose bodies can be read in place,
    held to `limits`. One timer per connection watches the one wait in progress, if any:
    for the next request's head, for body bytes, or for the client to take the answer."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, limits: ServerLimits | None = None,
                 book: ConnectionBook | None = None) -> None:
        self.limits = limits or ServerLimits()
        # The server's connections, shared by all of them (`http_server.fast_protocol`).
        self.book = book if book is not None else ConnectionBook(self.limits)
        self.refused = False  # beyond its address's cap: its request is answered 503
        self.http = _Http(self, config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self._target: memoryview | None = None  # where the socket's bytes go while a readinto waits
        self._got = 0
        self._waiter: asyncio.Future[int] | None = None
        self._dropping = False  # reading the rest of a body the app answered before reading it all
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._idle_since = 0.0  # the connection came, or its last answer went out
        self._heard = 0.0  # the client's last body bytes, or the app's last ask for them
        self._write_paused = False
        self._unsent = 0  # the transport's backlog when the client was last seen taking bytes
        self._taken = 0.0  # ... and when

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]
        self.refused = not self.book.admit(self, client_address(transport))
        self.idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.gone(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._finish_wait(ClientDisconnect())
        self.http.connection_lost(exc)

    def eof_received(self) -> None:
        self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()
        self._write_paused = True
        self._unsent, self._taken = self.http.transport.get_write_buffer_size(), self.http.loop.time()
        self._watch_soon()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.http.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._got :]
        if self._dropping:
            return _read_buffer()[: min(BUFFER, self.http.body_left)]
        return _read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._heard = self.http.loop.time()
        if self._dropping:
            self.http.body_left -= nbytes
            if self.http.body_left == 0:
                self._dropping = False
                self.http.body_done()
                self.http.response_done()
            return
        if self._target is None:
            self.http.data_received(_read_buffer()[:nbytes])  # type: ignore[arg-type]
            return
        self._got += nbytes
        self.http.body_left -= nbytes
        if self._got == len(self._target):
            self._target = None
            self.http.flow.pause_reading()  # until the app asks for more
            if self.http.body_left == 0:
                self.http.body_done()
            self._finish_wait(self._got)

    def _finish_wait(self, result: int | BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self._target = None
        if waiter is not None and not waiter.done():
            if isinstance(result, BaseException):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)

    def abandon(self, cycle: RequestResponseCycle) -> None:
        if self._waiter is not None and cycle is self.http.cycle:
            self.http.flow.pause_reading()
            self._finish_wait(Abandoned())

    def close_now(self, cycle: RequestResponseCycle) -> None:
        """`cycle`'s connection is given up: abort it (no wait for a silent client to take a
        backlog). Its handler sees ClientDisconnect at its next read, or at once in one."""
        transport = self.http.transport
        if cycle is not self.http.cycle or transport is None or transport.is_closing():
            return
        log.info("closed the connection of %s: a newer attempt of its upload took over", self.http.client)
        cycle.keep_alive = False
        transport.abort()

    def drop_rest(self) -> None:
        """The answer is out before the body was read to its end: read the rest and drop it,
        then let the connection go on to its next request."""
        self._dropping = True
        self._heard = self.http.loop.time()
        self.http.flow.resume_reading()
        self._watch_soon()

    def request_began(self) -> None:
        """A request's head is in: a client that does not wait for 100 Continue sends its body now."""
        self._heard = self.http.loop.time()
        self.book.busy(self)
        self._watch_soon()

    def idle(self) -> None:
        """No request in progress from now: the next one's head is due within the idle timeout; the
        book may close this connection to make room for a new one."""
        self._idle_since = self.http.loop.time()
        self.book.idle(self)
        self._watch_soon()

    def reclaim(self) -> None:
        """Closed by the book to make room (idle: no request in progress, nothing to send)."""
        transport = self.http.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # the watch over the connection's one wait
    def _deadline(self) -> tuple[float, str] | None:
        """When the wait in progress times out, and what it waits for; None: no wait of the client's."""
        http, limits = self.http, self.limits
        due: list[tuple[float, str]] = []
        if self._write_paused:
            unsent = http.transport.get_write_buffer_size()
            if unsent < self._unsent:  # the client took some since the last look
                self._unsent, self._taken = unsent, http.loop.time()
            due.append((self._taken + limits.send_timeout_s, "took no byte of its answer"))
        if self._dropping or self._waiter is not None or http.waits_for_body():
            due.append((self._heard + limits.body_timeout_s, "sent no byte of its body"))
        elif not http.in_request():
            wait = min(limits.idle_timeout_s, REFUSED_HEAD_S) if self.refused else limits.idle_timeout_s
            due.append((self._idle_since + wait, "sent no request"))
        return min(due, default=None)

    def _watch_soon(self) -> None:
        """A wait may have begun: make sure the timer fires by its deadline."""
        due = self._deadline()
        if due is not None and due[0] < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due[0]
            self._timer = self.http.loop.call_at(due[0], self._watch)

    def _watch(self) -> None:
        self._timer, self._timer_at = None, math.inf
        transport = self.http.transport
        if transport is None or transport.is_closing():
            return
        due = self._deadline()
        if due is not None and self.http.loop.time() >= due[0]:
            log.info("closed the connection of %s: it %s within the limit", self.http.client, due[1])
            if self.http.cycle is not None:
                self.http.cycle.keep_alive = False
            if self._write_paused:
                transport.abort()  # a close would wait for the client to take the backlog first
            else:
                transport.close()
            return
        self._watch_soon()  # a later deadline (the client made progress), or none

    # the app's side
    async def readinto(self, cycle: RequestResponseCycle, view: memoryview) -> int:
        """Fill `view` with the next bytes of `cycle`'s body; fewer only at its end (0: no more)."""
        http = self.http
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if self._waiter is not None:
            raise RuntimeError("readinto: a read of this connection is in progress")
        if cycle.waiting_for_100_continue and not http.transport.is_closing():
            http.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        http.continued = True
        got = 0
        if cycle.body:  # taken by the parser already
            got = min(len(view), len(cycle.body))
            view[:got] = cycle.body[:got]
            cycle.body = cycle.body[got:]
        if cycle is not http.cycle or cycle.response_complete:
            return got  # the parser took this body whole and went on to a pipelined request; or answered
        want = min(len(view) - got, http.body_left)
        if want == 0 or not cycle.more_body:
            return got
        if cycle.disconnected:
            raise ClientDisconnect()
        http.direct = True
        self._target, self._got = view[got : got + want], 0
        waiter = self._waiter = http.loop.create_future()
        self._heard = http.loop.time()
        http.flow.resume_reading()
        self._watch_soon()
        try:
            return got + await waiter
        finally:
            if self._waiter is waiter or not waiter.done():  # cancelled: the view is not ours to fill any more
                self._waiter, self._target = None, None
                http.flow.pause_reading()
                cycle.keep_alive = False


class _Http(HttpToolsProtocol):
    """uvicorn's protocol, told how much of the body it has not seen and offering `readinto`."""

    def __init__(self, outer: ReadIntoProtocol, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.outer = outer
        self.body_left = 0  # body bytes of the current request not yet read, by the parser or readinto
        self.direct = False  # some of them went past the parser
        self.chunked = False  # the current request's body has no length
        self.expect = False  # its client waits for 100 Continue before it sends the body
        self.continued = False  # ... and was told to go on, or sent some anyway
        self.drop_limit = outer.limits.drop_limit_bytes

    def on_headers_complete(self) -> None:
        previous = self.cycle
        # The book's count, not uvicorn's: a connection the book closed to make room is out of it at once.
        over = self.outer.book.count() > self.outer.limits.max_connections
        refused = self.outer.refused
        # read by uvicorn's on_headers_complete
        self.app = _over_address_cap if refused else _over_capacity if over else self.config.loaded_app
        super().on_headers_complete()
        self.direct = self.chunked = self.continued = False
        self.expect = self.expect_100_continue
        self.body_left = 0
        self.drop_limit = self.outer.limits.drop_limit_bytes
        self.outer.request_began()
        if self.cycle is previous or self.cycle.scope is not self.scope:
            return  # an upgrade: no request cycle of ours
        if over and not refused:
            log.warning("%d connections open, more than max_connections (%d), none idle: answered 503",
                        self.outer.book.count(), self.outer.limits.max_connections)
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
        if self.scheme == "http":  # not through TLS, which must encrypt every byte itself
            extensions[SEND] = SocketSink(self.outer, self.cycle)
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                self.chunked = True
                return  # only the parser knows where it ends
            if name == b"content-length":
                length = value
        if length is None or not length.isdigit():
            return
        self.body_left = int(length)
        extensions[READINTO] = SocketBodySource(self.outer, self.cycle)

    def on_body(self, body: bytes) -> None:
        self.body_left -= len(body)
        self.continued = True
        if self.chunked and self.cycle.response_complete:  # the rest of a chunked body, dropped by the parser
            self.drop_limit -= len(body)
            if self.drop_limit < 0:
                self.transport.close()
        super().on_body(body)

    def in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def waits_for_body(self) -> bool:
        """Whether the current request's body is due from the client now, through the parser:
        not all in, reading not paused by us, and the client not waiting for 100 Continue."""
        cycle = self.cycle
        return (self.in_request() and cycle.more_body and not self.direct and not self.flow.read_paused
                and not cycle.waiting_for_100_continue)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        unread = self.body_left > 0 or (self.chunked and cycle.more_body)  # answered before the body was all in
        if unread and not self.transport.is_closing() and not self.pipeline and cycle.response_complete:
            if (self.expect and not self.continued) or self.body_left > self.drop_limit:
                cycle.keep_alive = False  # the rest may never come, or is too much to wait for
                self.transport.close()
            elif not self.chunked:  # (a chunked body's rest goes through the parser, see on_body)
                self.outer.drop_rest()  # then `response_done`
                return
        self.response_done()

    def response_done(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.outer.idle()

    def body_done(self) -> None:
        """The body was read to its end past the parser: the next request needs a fresh one."""
        self.cycle.more_body = False
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3 has no leniencies
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
