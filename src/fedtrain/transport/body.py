"""An upload's body as the coordinator reads it (`Body`), whichever path it comes by: from a
`BodySource` (the fast path: the socket read straight into the caller's memory) or from
the ASGI app's `receive()` chunks (the plain path)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from fedtrain.transport.protocols import Abandoned, BodySource

__all__ = ["Abandoned", "Body"]


class Body:
    """An upload's body, read into the coordinator's own memory (`readinto`).

    From a `BodySource` (the fast path, `READINTO`: the socket is read straight into the
    memory the caller names, no copy of ours, none of the HTTP server's); otherwise (the
    stock protocol, another server, a test) the body comes as the ASGI app's chunks, copied
    out. Bytes read ahead (`unread`) are served first. `abandon()` stops a `readinto` in
    progress at once: it raises `Abandoned`, and nothing is written into its memory after that."""

    def __init__(self, chunks: AsyncIterator[bytes] | None = None, source: BodySource | None = None) -> None:
        self._chunks = chunks
        self._source = source
        self._ahead: deque[memoryview] = deque()
        self._abandoned = False
        self._stop: asyncio.Future[None] | None = None  # set by `abandon`: a wait for the next chunk ends
        self._counted: Callable[[int], None] | None = None

    def count_with(self, counted: Callable[[int], None]) -> None:
        """Call `counted(n)` with the number of bytes each read takes from the connection
        (bytes read ahead and given back are not counted again): a transfer's progress."""
        self._counted = counted

    @classmethod
    def of(cls, body: Body | AsyncIterator[bytes]) -> Body:
        return body if isinstance(body, Body) else cls(body)

    async def readinto(self, view: memoryview) -> int:
        """Fill `view` with the next bytes of the body; fewer only at its end (0: no more)."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if self._abandoned:
            self._abandoned = False
            raise Abandoned()
        got = 0
        while self._ahead and got < len(view):
            piece = self._ahead[0]
            n = min(len(piece), len(view) - got)
            view[got : got + n] = piece[:n]
            got += n
            if n == len(piece):
                self._ahead.popleft()
            else:
                self._ahead[0] = piece[n:]
        if got == len(view):
            return got
        if self._source is not None:
            n = await self._source.readinto(view[got:])
            if self._counted is not None:
                self._counted(n)
            return got + n
        while got < len(view) and self._chunks is not None:
            chunk = await self._next_chunk()
            if self._counted is not None and chunk:
                self._counted(len(chunk))
            if self._abandoned:  # stopped while the chunk was awaited: it does not go into view
                self._abandoned = False
                if chunk:
                    self._ahead.append(memoryview(chunk))
                raise Abandoned()
            if chunk is None:
                self._chunks = None
                break
            if not chunk:
                continue
            n = min(len(chunk), len(view) - got)
            view[got : got + n] = memoryview(chunk)[:n]
            got += n
            if n < len(chunk):
                self._ahead.append(memoryview(chunk)[n:])
        return got

    async def _next_chunk(self) -> bytes | None:
        """The next of the ASGI app's chunks; a wait for it ends at once when `abandon` is called
        meanwhile (None: a silent connection's body, taken over by a newer attempt, is not waited for)."""
        assert self._chunks is not None
        if self._stop is None:
            self._stop = asyncio.get_running_loop().create_future()
        nxt: asyncio.Future[bytes | None] = asyncio.ensure_future(anext(self._chunks, None))
        await asyncio.wait([nxt, self._stop], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if nxt.done():
            return nxt.result()
        nxt.cancel()  # abandoned: the rest of this body is never read
        self._chunks = None
        return None

    async def read(self, n: int) -> bytes:
        """The next `n` bytes of the body (fewer only at its end)."""
        buf = bytearray(n)
        return bytes(buf[: await self.readinto(memoryview(buf))])

    def unread(self, data: bytes) -> None:
        """Give bytes back: the next reads return them first."""
        if data:
            self._ahead.appendleft(memoryview(data))

    def abandon(self) -> None:
        """Stop a `readinto` in progress (or the next one) now: it raises `Abandoned`."""
        self._abandoned = True
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        if self._source is not None:
            self._source.abandon()

    async def drain(self) -> None:
        """Let the rest of the body go: the answer does not wait for it. Nothing more is read
        here (a refusal from the headers reads no byte and sends no 100 Continue); once the
        answer is out, the HTTP server reads the rest and drops it, or closes the connection
        when that is too much or never comes (`readinto.ReadIntoProtocol`). A later
        `readinto` reads nothing."""
        self._abandoned = False
        self._ahead.clear()
        self._source = None
        self._chunks = None
