"""Responses written to the socket from worker threads: `SocketSink` (the `SEND` extension, a
`ResponseSink`) runs a pump over a `SocketOut` (a `ModelSender`) on the send pool.

Once the response has started, `await sink.run(pump)` runs `pump(out)` on a worker thread,
where `out` writes to the socket itself: `out.sendfile` from a file (the kernel copies page
cache to socket, no bytes object on the way) or `out.write_some` from memory. A pump that
is a generator yields whenever the socket takes no more (or a `Hold` to wait for): its
thread goes back to the pool and the event loop waits for the client, so a stalled
download holds no thread and never holds up the others. Threads: the event loop runs
`SocketSink.run`; the pumps' steps run on the send pool and touch only the socket they
were given. The plain path, without this extension, is a chunked StreamingResponse.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time
import typing
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import ClientDisconnect

from fedtrain.transport.protocols import Hold, Pump, Steps
from fedtrain.transport.server_limits import ServerLimits

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["SendTimeout", "SocketOut", "SocketSink", "close_send_pool"]


class Connection(Protocol):
    """What a sink needs of the connection it answers on (`readinto.ReadIntoProtocol`)."""

    http: Any  # the connection's uvicorn HTTP protocol
    limits: ServerLimits


class SendTimeout(TimeoutError):
    """The client took no byte of the response for `ServerLimits.send_timeout_s`."""


class SocketOut:
    """The socket of one response, written from a worker thread (`SocketSink.run`), a `ModelSender`."""

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


def close_send_pool() -> None:
    """Stop the send pool's threads (idle once no response is being sent); the next response
    starts a new pool. For the end of a process's serving: an idle worker left behind is a
    thread the process's exit waits for (`fedtrain.cli.commands.run`)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _advance(steps: Steps, out: SocketOut) -> object:
    """Take a pump's steps on this (worker) thread until they end (`_DONE`) or must wait longer
    than a moment: then return what for (None: the socket, else a `Hold`)."""
    for hold in steps:
        if hold is None and out.ready(SPIN_S):
            continue
        return hold
    return _DONE


class SocketSink:
    """One response's body, written to the socket from a worker thread (the `SEND` extension,
    a `ResponseSink`)."""

    def __init__(self, protocol: Connection, cycle: RequestResponseCycle) -> None:
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
            raise RuntimeError("SocketSink.run: start the response first, and only once")
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
