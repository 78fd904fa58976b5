"""uvicorn's httptools protocol, with request bodies that can be read straight into the caller's memory.

Stock, each piece of an upload's body is copied four times on its way to our code: the
event loop reads it into a fresh `bytes`, the HTTP parser copies it out as another,
uvicorn appends it to the request's buffer and copies that into the ASGI message. For a
400 MB upload those copies (and a pause and resume of the socket for every ~256 KiB)
cost more than the network does here.

`ReadIntoProtocol` is an `asyncio.BufferedProtocol` around uvicorn's `HttpToolsProtocol`:
headers, small bodies, responses and keep-alive are all uvicorn's. A request with a
Content-Length carries an ASGI extension, `scope["extensions"][READINTO]`, a `BodySource`:
its `readinto(view) -> int` fills `view` with the next body bytes (fewer only at the end
of the body; 0 once it is all read), and `abandon()` stops a `readinto` in progress at
once (it raises `Abandoned`): no byte lands in `view` after that. Bytes the parser has
already taken are served first; then the socket is read straight into `view`, past the
parser, which is replaced by a fresh one when the body is complete. If the app answers
before it read such a body to its end, the rest is read and dropped after the response,
as uvicorn does with any body, and the connection serves its next request; if a
`readinto` is cancelled, the connection is closed after the response. Do not mix
`readinto` and `receive()` on one request; an app that only uses `receive()` never
notices the difference.

`readinto` raises starlette's `ClientDisconnect` if the client goes away meanwhile.

Responses go the other way round: a plain-HTTP request carries `scope["extensions"][SEND]`,
a `ResponseSink`. Once the response has started, `await sink.run(pump)` runs `pump(out)`
on a worker thread, where `out` writes to the socket itself: `out.sendfile` from a file
(the kernel copies page cache to socket, no bytes object on the way) or `out.write_some`
from memory. Stock, a 400 MB download goes through 800 chunks of `bytes` and the
transport's flow control; `out` skips both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

READINTO = "fedtrain.readinto"
SEND = "fedtrain.send"
# The loop reads the socket into this buffer when no `readinto` waits: headers, small bodies.
BUFFER = 256 << 10


# What this module relies on in uvicorn's httptools protocol, beyond the ASGI interface:
# names its classes set up (checked in their code, so nothing is started to check them).
_RELIED_ON = {
    "HttpToolsProtocol.__init__": {"parser", "cycle", "flow", "transport", "headers", "scope", "scheme"},
    "RequestResponseCycle.__init__": {"body", "more_body", "keep_alive", "disconnected", "response_started",
                                      "response_complete", "expected_content_length", "waiting_for_100_continue"},
}
_METHODS = ("data_received", "on_headers_complete", "on_body", "on_response_complete", "connection_made",
            "connection_lost", "eof_received", "pause_writing", "resume_writing")


def supported() -> bool:
    """Whether the installed uvicorn's httptools protocol has what `ReadIntoProtocol` relies on;
    if not, the coordinator serves with the stock protocol (`server.uvicorn_config`)."""
    owners = {"HttpToolsProtocol": HttpToolsProtocol, "RequestResponseCycle": RequestResponseCycle}
    for where, names in _RELIED_ON.items():
        owner, method = where.split(".")
        code = getattr(getattr(owners[owner], method, None), "__code__", None)
        if code is None or not names <= set(code.co_names):
            return False
    return all(callable(getattr(HttpToolsProtocol, name, None)) for name in _METHODS)


class Abandoned(Exception):
    """A `readinto` stopped by `abandon()`."""


class BodySource:
    """One request's body, read into the caller's memory (the `READINTO` extension)."""

    def __init__(self, protocol: ReadIntoProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol, self._cycle = protocol, cycle

    async def readinto(self, view: memoryview) -> int:
        """Fill `view` with the next bytes of the body; fewer only at its end (0: no more)."""
        return await self._protocol.readinto(self._cycle, view)

    def abandon(self) -> None:
        """Stop a `readinto` in progress now: it raises `Abandoned`, and `view` is not written again."""
        self._protocol.abandon(self._cycle)


class SocketOut:
    """The socket of one response, written from a worker thread (`ResponseSink.run`)."""

    POLL_MS = 250

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sent = 0
        self.cancelled = threading.Event()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)

    def write_some(self, view: memoryview) -> int:
        """Write what the socket takes now of `view` (0 when it takes nothing); never blocks."""
        try:
            n = os.write(self.fd, view)
        except BlockingIOError:
            return 0
        self.sent += n
        return n

    def wait(self) -> None:
        """Until the socket takes more bytes; raises if the client is gone or the send was cancelled."""
        while not self.cancelled.is_set():
            for _, flags in self._poll.poll(self.POLL_MS):
                if flags & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise ConnectionResetError("the client closed the connection")
                return
        raise ConnectionAbortedError("the response was cancelled")

    def sendall(self, view: memoryview) -> None:
        while view:
            n = self.write_some(view)
            if n:
                view = view[n:]
            else:
                self.wait()

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        """Send `count` bytes of the file `fd` from `offset`; the kernel copies them."""
        while count:
            if self.cancelled.is_set():
                raise ConnectionAbortedError("the response was cancelled")
            try:
                n = os.sendfile(self.fd, fd, offset, count)
            except BlockingIOError:
                self.wait()
                continue
            if n == 0:
                raise EOFError("the file ended before the response's bytes")
            offset, count, self.sent = offset + n, count - n, self.sent + n


# A download holds its thread for as long as its client takes to read it (minutes over a
# slow link), so sends have threads of their own: on asyncio's default pool (6 threads on
# 2 cores) a few slow downloads would hold up every spool write, fold and commit.
SEND_THREADS = 64
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _send_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix="fedtrain-send")
        return _pool


class ResponseSink:
    """One response's body, written to the socket from a worker thread (the `SEND` extension)."""

    def __init__(self, protocol: ReadIntoProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol, self._cycle = protocol, cycle

    async def run(self, pump: Callable[[SocketOut], None]) -> None:
        """Run `pump(out)` on a worker thread once the response's headers are out; the bytes
        it sends count toward the response's Content-Length. Raises `ClientDisconnect` when
        the client goes away; if cancelled, the connection is closed."""
        cycle, http = self._cycle, self._protocol.http
        transport = http.transport
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError("ResponseSink.run: start the response first, and only once")
        while transport.get_write_buffer_size() and not cycle.disconnected:  # the headers, normally out at once
            await (http.flow.drain() if http.flow.write_paused else asyncio.sleep(0.001))
        if cycle.disconnected or transport.is_closing():
            raise ClientDisconnect()
        # The thread writes through a descriptor of its own: should the loop close the
        # connection meanwhile (the client reset it), the number cannot be reused under it.
        out = SocketOut(os.dup(transport.get_extra_info("socket").fileno()))
        work = asyncio.get_running_loop().run_in_executor(_send_pool(), pump, out)
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            out.cancelled.set()
            await asyncio.wait({work})  # off the socket (within POLL_MS) before it is closed
            if not work.cancelled():
                work.exception()  # its ConnectionAbortedError is the cancel's own doing
            self._give_up(transport)
            raise
        except OSError:  # the client went away (or the pump gave up)
            self._give_up(transport)
            deadline = time.monotonic() + 1.0  # let the loop see the connection go, so that uvicorn does too
            while not cycle.disconnected and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            raise ClientDisconnect() from None
        finally:
            cycle.expected_content_length -= out.sent
            if work.done():
                os.close(out.fd)

    def _give_up(self, transport: asyncio.Transport) -> None:
        """The response is not in step with its Content-Length any more: close the connection."""
        self._cycle.keep_alive = False
        transport.close()


class ReadIntoProtocol(asyncio.BufferedProtocol):
    """An HTTP/1.1 connection (uvicorn's `HttpToolsProtocol`) whose bodies can be read in place."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.http = _Http(self, config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self._buffer = memoryview(bytearray(BUFFER))
        self._target: memoryview | None = None  # where the socket's bytes go while a readinto waits
        self._got = 0
        self._waiter: asyncio.Future[int] | None = None
        self._dropping = False  # reading the rest of a body the app answered before reading it all

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish_wait(ClientDisconnect())
        self.http.connection_lost(exc)

    def eof_received(self) -> None:
        self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._got :]
        if self._dropping:
            return self._buffer[: min(len(self._buffer), self.http.body_left)]
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._dropping:
            self.http.body_left -= nbytes
            if self.http.body_left == 0:
                self._dropping = False
                self.http.body_done()
                self.http.response_done()
            return
        if self._target is None:
            self.http.data_received(self._buffer[:nbytes])  # type: ignore[arg-type]
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

    def drop_rest(self) -> None:
        """The response is out, but part of the body that went past the parser is not read:
        read it and drop it, then let the connection go on to its next request."""
        self._dropping = True
        self.http.flow.resume_reading()

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
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        http.flow.resume_reading()
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

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        self.direct = False
        self.body_left = 0
        if self.cycle is previous or self.cycle.scope is not self.scope:
            return  # an upgrade: no request cycle of ours
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
        if self.scheme == "http":  # not through TLS, which must encrypt every byte itself
            extensions[SEND] = ResponseSink(self.outer, self.cycle)
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return  # chunked: only the parser knows where it ends
            if name == b"content-length":
                length = value
        if length is None or not length.isdigit():
            return
        self.body_left = int(length)
        extensions[READINTO] = BodySource(self.outer, self.cycle)

    def on_body(self, body: bytes) -> None:
        self.body_left -= len(body)
        super().on_body(body)

    def on_response_complete(self) -> None:
        if self.direct and self.body_left > 0 and not self.transport.is_closing():
            self.outer.drop_rest()  # then `response_done`
            return
        super().on_response_complete()

    def response_done(self) -> None:
        super().on_response_complete()

    def body_done(self) -> None:
        """The body was read to its end past the parser: the next request needs a fresh one."""
        self.cycle.more_body = False
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3 has no leniencies
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
