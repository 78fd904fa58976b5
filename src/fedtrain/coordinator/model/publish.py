"""Serving the global model: from memory until the weights move on, then from the file.

`ModelStream` is one download of one version, `Published` the version served from memory
(with the compressed delta that leads to it, if any: `deltas.py`) and `WeightsGuard` what
orders copies of the weights against the next outer step. By default a download holds back
its last piece until the round is committed.

More: docs/architecture.md, "coordinator/model/publish.py".
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.transport.chunks import chunks_of
from fedtrain.transport.protocols import SEND, Hold, ModelSender, Steps
from fedtrain.wire import EncodedBody

if TYPE_CHECKING:
    import torch

SEND_PIECE = 4 << 20  # most a nonblocking write from memory can take at once (the socket buffer takes less)

T = TypeVar("T")


class WeightsGuard:
    """Orders copies of the master weights against changes to them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0  # bumped (under the lock) by every change of the master weights


class NotCommitted(ConnectionAbortedError):
    """The commit of a version served from memory failed: its downloads are cut short."""


@dataclass
class Published:
    """A version served from memory: while its checkpoint is being written, and once committed
    until the next outer step."""

    version: int
    digest: str
    body: EncodedBody
    epoch: int
    hold: bool = False  # commit first: each download's last piece waits for the commit
    durable: bool = False
    settled: threading.Event = field(default_factory=threading.Event)  # the commit is over, either way
    # The same, for waiters on the event loop (settle() runs there: `rounds.Rounds`).
    settled_async: asyncio.Event = field(default_factory=asyncio.Event)
    # Compressed downloads: the step from the version before to this one, as sent (`deltas.py`).
    delta: PublishedDelta | None = None

    def settle(self, durable: bool) -> None:
        """On the event loop: the commit is over, durable or not."""
        if not self.settled.is_set():
            self.durable = durable
            self.settled.set()
            self.settled_async.set()

    def check_durable(self) -> None:
        if not (self.settled.is_set() and self.durable):
            raise NotCommitted(f"global model version {self.version} was not committed")

    def wait(self, cancelled: threading.Event) -> None:
        """On a worker thread: until the commit is over; raises if it failed or the send was cancelled."""
        while not self.settled.wait(0.25):
            if cancelled.is_set():
                raise ConnectionAbortedError("the response was cancelled")
        self.check_durable()

    async def wait_async(self) -> None:
        """On the event loop: until the commit is over; raises if it failed."""
        await self.settled_async.wait()
        self.check_durable()


@dataclass
class PublishedDelta:
    """The step from version `from_version` to the published version `target`, as sent: `body`
    (compressed, with the target's digest and metadata), and the residual E after it."""

    from_version: int
    target: Published
    body: EncodedBody
    residual: dict[str, torch.Tensor]  # E after this step, written with the version's checkpoint (the
    # next merge, which waits for that commit, updates these tensors in place)

    @property
    def digest(self) -> str:
        return self.body.digest()


@dataclass
class ModelStream:
    """One download of one global version: its headers' values and its bytes."""

    version: int
    digest: str
    size: int
    path: Path
    files: CheckpointDir
    memory: Published | None = None
    guard: WeightsGuard | None = None

    def __post_init__(self) -> None:
        # Opened now (file mode), so that a later prune cannot take the file mid-stream: an
        # open reader keeps it from being reused as a spare, and unlinking it is harmless.
        self._file: BinaryIO | None = self.files.open_reader(self.path) if self.memory is None else None

    def steps(self, out: ModelSender) -> Steps:
        """The download's one body producer: send the whole body through `out` (the socket on
        worker threads, `transport.ResponseSink`; or the plain path's chunks, `chunks_of`), yielding
        whenever the socket takes no more (None) or the commit is to be waited for (a `Hold`):
        from memory, a nonblocking write at a time under the guard lock (a slow client never
        holds it while it waits), else or then (once the weights moved on) by `sendfile` from
        the file. A held download waits for the commit before its last piece; raises
        `NotCommitted` (the connection is closed) when that commit failed."""
        offset = 0
        if self.memory is not None and self.guard is not None:
            offset = yield from memory_steps(self.memory.body, self.memory, self.guard, out)
            if offset == self.size:
                return
            self._file = self.files.open_reader(self.path)
        assert self._file is not None
        yield from out.sendfile_steps(self._file.fileno(), offset, self.size - offset)

    def pump(self, out: ModelSender) -> None:
        """`steps`, taken on this thread alone: it waits for the client and the commit itself."""
        out.run(self.steps(out))

    def close(self) -> None:
        if self._file is not None:
            self.files.close_reader(self.path, self._file)
            self._file = None


def memory_steps(body: EncodedBody, memory: Published, guard: WeightsGuard, out: ModelSender,
                 ) -> Generator[Hold | None, None, int]:
    """Send `body` (over the master weights as `memory` published them) through `out`, a
    nonblocking write at a time under the guard lock; a held body's last piece waits for the
    commit (`NotCommitted` when it failed). Returns the bytes sent: all, or fewer when the
    weights moved on (then the committed file holds the rest)."""
    offset, moved = 0, False
    for view, last in pieces(body, SEND_PIECE):
        if last and memory.hold:
            if not memory.settled.is_set():
                yield memory  # waited for on the loop, or by `pump` on its thread
            memory.check_durable()
        while view and not moved:
            with guard.lock:
                moved = guard.epoch != memory.epoch
                n = 0 if moved else out.write_some(view)
            if n:
                view, offset = view[n:], offset + n
            elif not moved:
                yield None
        if moved:
            memory.check_durable()
            break
    return offset


def pieces(body: EncodedBody, size: int) -> Iterator[tuple[memoryview, bool]]:
    """The body in pieces of at most `size` bytes, each with whether it is the last."""
    held: memoryview | None = None
    for view in body:
        for start in range(0, view.nbytes, size):
            if held is not None:
                yield held, False
            held = view[start : start + size]
    if held is not None:
        yield held, True


class Download(Protocol):
    """One download's bytes, produced once (`steps`) and sent by either adapter: `ModelStream`
    (the whole model), `slices.SliceStream` (rows of it)."""

    def steps(self, out: ModelSender) -> Steps: ...

    def close(self) -> None: ...


class ModelResponse(StreamingResponse):
    """A model download: its `steps` written straight to the socket where the server offers it
    (`transport.SEND`: plain HTTP with fast IO on), else taken on the loop and streamed in
    chunks (`chunks_of`, the plain path). The route hands it a `transport.ranges.Ranged`
    download: the whole body (200) or the byte range asked for (206)."""

    def __init__(self, stream: Download, headers: dict[str, str], status_code: int = 200) -> None:
        super().__init__(chunks_of(stream), status_code, media_type="application/octet-stream", headers=headers)
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sink = scope.get("extensions", {}).get(SEND)
        if sink is None:
            await super().__call__(scope, receive, send)
            return
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await sink.run(self.stream.steps)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnect:
            pass  # the client went away: nothing to answer
        finally:
            self.stream.close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # never started: nothing runs
