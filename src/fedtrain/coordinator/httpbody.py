"""uvicorn's httptools protocol, with request bodies read straight into the caller's memory,
responses written from worker threads, and bounds on what one connection may hold.

Stock, each piece of an upload's body is copied four times on its way to our code: the
event loop reads it into a fresh `bytes`, the HTTP parser copies it out as another,
uvicorn appends it to the request's buffer and copies that into the ASGI message.

`ReadIntoProtocol` is an `asyncio.BufferedProtocol` around uvicorn's `HttpToolsProtocol`:
headers, small bodies, responses and keep-alive are all uvicorn's. A request with a
Content-Length carries an ASGI extension, `scope["extensions"][READINTO]`, a `BodySource`:
its `readinto(view) -> int` fills `view` with the next body bytes (fewer only at the end
of the body; 0 once it is all read), and `abandon()` stops a `readinto` in progress at
once (it raises `Abandoned`): no byte lands in `view` after that. Bytes the parser has
already taken are served first; then the socket is read straight into `view`, past the
parser, which is replaced by a fresh one when the body is complete. Do not mix `readinto`
and `receive()` on one request; an app that only uses `receive()` never notices.

An app may answer before it read the body (a refusal from the headers): nothing asked for
the body, so no `100 Continue` goes out. After the answer the rest of the body is read and
dropped (the client, which sends its body whole, then reads the answer) and the connection
serves its next request; it is closed instead when the client waits for `100 Continue`
(it holds its body back), when more is left than `ServerLimits.drop_limit_bytes` (or what
the app allowed, `BodySource.allow_drop`; a chunked body's rest counts as it comes), or
if a `readinto` was cancelled.
`readinto` raises starlette's `ClientDisconnect` if the client goes away meanwhile.

Responses go the other way round: a plain-HTTP request carries `scope["extensions"][SEND]`,
a `ResponseSink`. Once the response has started, `await sink.run(pump)` runs `pump(out)`
on a worker thread, where `out` writes to the socket itself: `out.sendfile` from a file
(the kernel copies page cache to socket, no bytes object on the way) or `out.write_some`
from memory. A pump that is a generator yields whenever the socket takes no more (or a
`Hold` to wait for): its thread goes back to the pool and the event loop waits for the
client, so a stalled download holds no thread and never holds up the others.

What one connection may hold (`ServerLimits`): no buffer of its own (socket reads that no
`readinto` waits for go into one buffer per event-loop thread); no longer than
`idle_timeout_s` without a request, `body_timeout_s` of silence in a body it was asked
for, `send_timeout_s` without taking a byte of its answer; and beyond `max_connections`
its requests are answered 503. Threads: the event loop runs everything here but the
pumps' steps, which run on the send pool and touch only the socket they were given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import select
import socket
import threading
import time
import typing
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from fedtrain.errors import error_body

log = logging.getLogger("fedtrain.coordinator")

READINTO = "fedtrain.readinto"
SEND = "fedtrain.send"
# The loop reads the socket into this buffer when no `readinto` waits: headers, small bodies.
BUFFER = 256 << 10


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
    """Open connections at most: a request on one beyond them is answered 503, and that connection closed."""
    drop_limit_bytes: int = 64 << 20
    """Body bytes left unread once the answer is out: read and dropped if at most this many (so that a
    client sending its body whole reads the answer), else the connection is closed."""

    def __post_init__(self) -> None:
        for name in ("send_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name} must be a positive number of seconds, not {value!r}")
        if self.max_connections < 1 or self.drop_limit_bytes < 0:
            raise ValueError(f"ServerLimits: max_connections must be at least 1, drop_limit_bytes at least 0: {self}")


# What this module relies on in uvicorn's httptools protocol, beyond the ASGI interface:
# names its classes set up (checked in their code, so nothing is started to check them).
_RELIED_ON = {
    "HttpToolsProtocol.__init__": {"parser", "cycle", "flow", "transport", "headers", "scope", "scheme", "app",
                                   "connections", "pipeline", "expect_100_continue", "loop"},
    "HttpToolsProtocol.on_headers_complete": {"app"},
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


_local = threading.local()


def _read_buffer() -> memoryview:
    """This thread's buffer for socket reads no `readinto` waits for. One per event loop, not
    per connection: the loop hands it out (`get_buffer`) and gets it back filled
    (`buffer_updated`) with nothing in between, and the parser copies out what it keeps."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(bytearray(BUFFER))
    return buffer


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

    def allow_drop(self, nbytes: int) -> None:
        """Should the answer go out before the body was read, up to `nbytes` of it (more than
        `ServerLimits.drop_limit_bytes`) may be read and dropped before the connection goes on."""
        if self._cycle is self._protocol.http.cycle:
            self._protocol.http.drop_limit = max(self._protocol.http.drop_limit, nbytes)


class SendTimeout(TimeoutError):
    """The client took no byte of the response for `ServerLimits.send_timeout_s`."""


class Hold(Protocol):
    """What a pump waits for before it goes on (e.g. its round's commit): on its thread, or on the loop."""

    def wait(self, cancelled: threading.Event) -> None: ...

    async def wait_async(self) -> None: ...


class SocketOut:
    """The socket of one response, written from a worker thread (`ResponseSink.run`)."""

    POLL_S = 0.25  # how often a wait on a thread looks at `cancelled`

    def __init__(self, fd: int, timeout_s: float = ServerLimits.send_timeout_s) -> None:
        self.fd = fd
        self.timeout_s = timeout_s
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

    def ready(self, wait_s: float) -> bool:
        """Whether the socket takes more bytes within `wait_s`; raises if the client left or the send is cancelled."""
        if self.cancelled.is_set():
            raise ConnectionAbortedError("the response was cancelled")
        for _, flags in self._poll.poll(wait_s * 1000):
            if flags & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                raise ConnectionResetError("the client closed the connection")
            return True
        return False

    def wait(self) -> None:
        """On this thread, until the socket takes more bytes: `SendTimeout` after `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        while not self.ready(min(self.POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise SendTimeout(f"the client took no byte for {self.timeout_s:g}s")

    async def writable(self) -> None:
        """On the event loop, until the socket takes more bytes: `SendTimeout` after `timeout_s`."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def on_writable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_writer(self.fd, on_writable)
        try:
            await asyncio.wait_for(ready, self.timeout_s)
        except asyncio.TimeoutError:
            raise SendTimeout(f"the client took no byte for {self.timeout_s:g}s") from None
        finally:
            loop.remove_writer(self.fd)

    def write_steps(self, view: memoryview) -> Iterator[None]:
        """Send all of `view`, yielding whenever the socket takes nothing (a pump's steps)."""
        while view:
            n = self.write_some(view)
            if n:
                view = view[n:]
            else:
                yield

    def sendfile_steps(self, fd: int, offset: int, count: int) -> Iterator[None]:
        """Send `count` bytes of the file `fd` from `offset` (the kernel copies them), yielding
        whenever the socket takes nothing."""
        while count:
            if self.cancelled.is_set():
                raise ConnectionAbortedError("the response was cancelled")
            try:
                n = os.sendfile(self.fd, fd, offset, count)
            except BlockingIOError:
                yield
                continue
            if n == 0:
                raise EOFError("the file ended before the response's bytes")
            offset, count, self.sent = offset + n, count - n, self.sent + n

    def run(self, steps: Iterator[Hold | None]) -> None:
        """Take a pump's steps to their end on this thread, waiting here whenever they yield."""
        for hold in steps:
            if hold is None:
                self.wait()
            else:
                hold.wait(self.cancelled)

    def sendall(self, view: memoryview) -> None:
        self.run(self.write_steps(view))

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        self.run(self.sendfile_steps(fd, offset, count))


# Pumps' steps run on threads of their own: on asyncio's default pool (6 threads on 2 cores)
# downloads would hold up every spool write, fold and commit. A step holds its thread only
# while the socket takes bytes (and SPIN_S after), so the pool bounds the downloads being
# copied at once, not those in progress.
SEND_THREADS = 64
SPIN_S = 0.002  # a socket full for longer than this is waited for on the loop, not on the thread
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_DONE = object()


def _send_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix="fedtrain-send")
        return _pool


def _advance(steps: Steps, out: SocketOut) -> object:
    """Take a pump's steps on this (worker) thread until they end (`_DONE`) or must wait longer
    than a moment: then return what for (None: the socket, else a `Hold`)."""
    for hold in steps:
        if hold is None and out.ready(SPIN_S):
            continue
        return hold
    return _DONE


Steps = Generator["Hold | None", None, None]
Pump = Callable[[SocketOut], "Steps | None"]


class ResponseSink:
    """One response's body, written to the socket from a worker thread (the `SEND` extension)."""

    def __init__(self, protocol: ReadIntoProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol, self._cycle = protocol, cycle

    async def run(self, pump: Pump) -> None:
        """Send the response's body with `pump(out)` once its headers are out; the bytes sent
        count toward its Content-Length. A pump that returns steps (a generator) is taken step
        by step, its waits on the loop; one that returns None sent it all on its thread.
        Raises `ClientDisconnect` when the client goes away or takes no byte for the send
        timeout; if cancelled, the connection is closed."""
        cycle, http = self._cycle, self._protocol.http
        transport = http.transport
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError("ResponseSink.run: start the response first, and only once")
        while transport.get_write_buffer_size() and not cycle.disconnected:  # the headers, normally out at once
            await (http.flow.drain() if http.flow.write_paused else asyncio.sleep(0.001))
        if cycle.disconnected or transport.is_closing():
            raise ClientDisconnect()
        # The threads write through a descriptor of its own: should the loop close the
        # connection meanwhile (the client reset it), the number cannot be reused under them.
        out = SocketOut(os.dup(transport.get_extra_info("socket").fileno()), self._protocol.limits.send_timeout_s)
        steps: Steps | None = None
        try:
            steps = await self._on_thread(out, pump, out)
            while steps is not None:
                wait = await self._on_thread(out, _advance, steps, out)
                if wait is _DONE:
                    break
                if wait is None:
                    await out.writable()
                else:
                    await typing.cast(Hold, wait).wait_async()
        except asyncio.CancelledError:
            self._give_up(transport)
            raise
        except OSError as e:  # the client went away, took nothing for too long, or the pump gave up
            self._give_up(transport, abort=isinstance(e, SendTimeout))
            deadline = time.monotonic() + 1.0  # let the loop see the connection go, so that uvicorn does too
            while not cycle.disconnected and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            raise ClientDisconnect() from None
        finally:
            cycle.expected_content_length -= out.sent
            if steps is not None:
                steps.close()
            os.close(out.fd)  # no thread writes to it any more (`_on_thread` waits for them)

    def limit_kernel_buffer(self, nbytes: int) -> None:
        """Let the kernel hold about `nbytes` of this connection's unsent bytes, not megabytes: a
        client that stops reading a long stream of small writes (server-sent events) then
        backs up into the transport at once, where the app sees it (`flow.drain` waits, then
        the send timeout), instead of costing a copy per write for as long as the kernel absorbs."""
        sock = self._protocol.http.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)

    @staticmethod
    async def _on_thread(out: SocketOut, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the send pool; if cancelled, the thread is told to stop and waited for
        (off the socket within `SocketOut.POLL_S`) before the cancel goes on."""
        work = asyncio.get_running_loop().run_in_executor(_send_pool(), fn, *args)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            out.cancelled.set()
            await asyncio.wait({work})
            if not work.cancelled():
                work.exception()  # its ConnectionAbortedError is the cancel's own doing
            raise

    def _give_up(self, transport: asyncio.Transport, abort: bool = False) -> None:
        """The response is not in step with its Content-Length any more: close the connection."""
        self._cycle.keep_alive = False
        transport.abort() if abort else transport.close()


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The answer on a connection beyond `ServerLimits.max_connections`."""
    body = json.dumps(error_body(503, "over_capacity", "the coordinator has as many connections open as it "
                                 "takes; try again shortly")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class ReadIntoProtocol(asyncio.BufferedProtocol):
    """An HTTP/1.1 connection (uvicorn's `HttpToolsProtocol`) whose bodies can be read in place,
    held to `limits`. One timer per connection watches the one wait in progress, if any:
    for the next request's head, for body bytes, or for the client to take the answer."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, limits: ServerLimits | None = None) -> None:
        self.limits = limits or ServerLimits()
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
        self.idle()

    def connection_lost(self, exc: Exception | None) -> None:
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
        self._watch_soon()

    def idle(self) -> None:
        """No request in progress from now: the next one's head is due within the idle timeout."""
        self._idle_since = self.http.loop.time()
        self._watch_soon()

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
            due.append((self._idle_since + limits.idle_timeout_s, "sent no request"))
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
        over = len(self.connections) > self.outer.limits.max_connections
        self.app = _over_capacity if over else self.config.loaded_app  # read by uvicorn's on_headers_complete
        super().on_headers_complete()
        self.direct = self.chunked = self.continued = False
        self.expect = self.expect_100_continue
        self.body_left = 0
        self.drop_limit = self.outer.limits.drop_limit_bytes
        self.outer.request_began()
        if self.cycle is previous or self.cycle.scope is not self.scope:
            return  # an upgrade: no request cycle of ours
        if over:
            log.warning("%d connections open, more than max_connections (%d): answered 503",
                        len(self.connections), self.outer.limits.max_connections)
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
        if self.scheme == "http":  # not through TLS, which must encrypt every byte itself
            extensions[SEND] = ResponseSink(self.outer, self.cycle)
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
        extensions[READINTO] = BodySource(self.outer, self.cycle)

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
