"""The seams of fast IO, as small Protocols: what the coordinator reads an upload from
(`BodySource`), what a download writes through (`ResponseSink` running a pump over a
`ModelSender`), and what writes a checkpoint's bytes (`CheckpointWriter`).

Each has a plain path beside the fast one, and the code on either side of a seam never
learns which it got. An ASGI app finds the HTTP ones in `scope["extensions"]`: `READINTO`
(a `BodySource`, on a request with a Content-Length) and `SEND` (a `ResponseSink`, on plain
HTTP), both only where our protocol serves (`readinto.ReadIntoProtocol`); without them the
app reads `receive()` chunks and answers with a StreamingResponse. Nothing here imports
the server stack or torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from fedtrain.wire.encode import EncodedBody

READINTO = "fedtrain.readinto"
"""ASGI extension: the request's body as a `BodySource`."""
SEND = "fedtrain.send"
"""ASGI extension: the response's body written by a worker thread, a `ResponseSink`."""


class Abandoned(Exception):
    """A `readinto` stopped by `abandon()`."""


class BodySource(Protocol):
    """One request's body, read into memory the caller names."""

    async def readinto(self, view: memoryview) -> int:
        """Fill `view` with the next bytes of the body; fewer only at its end (0: no more).
        Raises starlette's `ClientDisconnect` if the client went away."""
        ...

    def abandon(self) -> None:
        """Stop a `readinto` in progress now: it raises `Abandoned`, and `view` is not written again."""
        ...

    def allow_drop(self, nbytes: int) -> None:
        """Should the answer go out before the body was read, up to `nbytes` of it may be read
        and dropped before the connection serves its next request."""
        ...


class Hold(Protocol):
    """What a pump waits for before it goes on (e.g. its round's commit): on its thread, or on the loop."""

    def wait(self, cancelled: threading.Event) -> None: ...

    async def wait_async(self) -> None: ...


class ModelSender(Protocol):
    """The socket of one download, written from a worker thread: from memory or from a file.
    `sent`: the bytes it has passed on so far (a send cut short midway counts what went)."""

    sent: int

    def write_some(self, view: memoryview) -> int:
        """Write what the socket takes now of `view` (0 when it takes nothing); never blocks."""
        ...

    def sendfile_steps(self, fd: int, offset: int, count: int) -> Iterator[Hold | None]:
        """Send `count` bytes of the file `fd` from `offset`, yielding whenever the socket takes
        nothing (None), or a `Hold` to wait for first (the plain path's read on a worker thread)."""
        ...

    def run(self, steps: Iterator[Hold | None]) -> None:
        """Take a pump's steps to their end on this thread, waiting here whenever they yield."""
        ...


Steps = Generator["Hold | None", None, None]
"""A pump's steps: each yield waits for the socket (None) or for a `Hold`."""
Pump = Callable[[ModelSender], "Steps | None"]
"""Sends a response's body through a `ModelSender`: whole on its thread (None), or as steps."""


class ResponseSink(Protocol):
    """One response's body, sent by a pump on a worker thread once its headers are out."""

    async def run(self, pump: Pump) -> None:
        """Send the body with `pump(sender)`; raises starlette's `ClientDisconnect` when the
        client goes away or takes nothing for the send timeout."""
        ...

    def limit_kernel_buffer(self, nbytes: int) -> None:
        """Let the kernel hold about `nbytes` of this connection's unsent bytes."""
        ...


class CheckpointWriter(Protocol):
    """Writes an encoded body into an open file (from offset 0, cutting off what lay beyond),
    for the caller to fsync; and places tensors where it can take them from memory."""

    def write(self, fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
        """Write `body` into `fd`; returns its digest (`digest` when the caller knows it) and the
        misfits: tensors (by name) this writer copied rather than took from their memory, each
        with the offset (mod the writer's alignment) its memory should have (`place`)."""
        ...

    def place(self, t: torch.Tensor, offset: int, consume: bool = False) -> torch.Tensor | None:
        """A copy of misfit `t` in memory this writer takes directly for a file offset `offset`
        (None: it cannot); `consume` may give `t`'s memory back as it copies."""
        ...
