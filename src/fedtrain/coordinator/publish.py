"""Serving the global model: from its checkpoint file, or from memory before it is on disk.

By default a round's new model is served only once it is committed: its checkpoint files
are written and fsync'd and the database says so. With `publish_first: true` the
coordinator serves the new model straight from the master weights as soon as the outer
step is done and writes the checkpoint meanwhile, which takes the commit off the round
trip. The weights must then not change under a download: every chunk is copied out under
the `WeightsGuard` lock, and the next outer step (which takes the same lock and bumps the
epoch) only runs once this round's commit is done; a download still streaming from memory
when the epoch moves continues from the committed file at the same offset. The bytes are
the same either way: the file is the same `EncodedBody` (same tensors, same metadata).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.httpbody import SEND, SocketOut
from fedtrain.wire import EncodedBody

# Below the coordinator's mmap threshold (1 MiB, see `server.tune_allocator`): chunks come from
# the heap and are reused, where 4 MiB chunks were each a fresh mmap whose page faults and munmap
# cost more than the copy (downloads ran ~2x faster after the change).
CHUNK = 512 << 10
READS_PER_HOP = 8
SEND_PIECE = 4 << 20  # most a nonblocking write from memory can take at once (the socket buffer takes less)
SLOW_READ_S = 0.005


class WeightsGuard:
    """Orders copies of the master weights against changes to them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0  # bumped (under the lock) by every change of the master weights


@dataclass
class Published:
    """A version served from memory while its checkpoint is being written."""

    version: int
    digest: str
    body: EncodedBody
    epoch: int


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
    on_close: Callable[[bool], None] | None = None  # told, once, whether the whole body went out

    def __post_init__(self) -> None:
        # Opened now (file mode), so that a later prune cannot take the file mid-stream: an
        # open reader keeps it from being reused as a spare, and unlinking it is harmless.
        self._file: BinaryIO | None = self.files.open_reader(self.path) if self.memory is None else None
        self._sent_all = False

    async def chunks(self) -> AsyncIterator[bytes]:
        offset = 0
        try:
            if self.memory is not None and self.guard is not None:
                for view in _pieces(self.memory.body, CHUNK):
                    with self.guard.lock:
                        if self.guard.epoch != self.memory.epoch:
                            break  # the weights moved on: the rest comes from the committed file
                        data = bytes(view)
                    offset += len(data)
                    yield data
                else:
                    self._sent_all = True
                    return
                self._file = self.files.open_reader(self.path)
                self._file.seek(offset)
            file = self._file
            assert file is not None
            # From the page cache (a checkpoint just written is there) a chunk is a ~50 µs
            # copy: read in the event loop, a 400 MB download took 0.09-0.14 s on the server
            # side, against 0.28-0.48 s with the reads on a worker thread (the stream waited
            # for every hop). A read slower than SLOW_READ_S is a disk's: the rest of the
            # file is then read on a worker thread, so the loop waits on the disk once.
            while True:
                t0 = time.perf_counter()
                chunk = file.read(CHUNK)
                slow = time.perf_counter() - t0 > SLOW_READ_S
                if not chunk:
                    self._sent_all = True
                    return
                yield chunk
                if slow:
                    break
            while chunks := await asyncio.to_thread(_read_chunks, file, READS_PER_HOP):
                for chunk in chunks:
                    yield chunk
            self._sent_all = True
        finally:
            self.close()

    def pump(self, out: SocketOut) -> None:
        """Send the whole body through `out`, on a worker thread (`httpbody.ResponseSink`): from
        memory, a nonblocking write at a time under the guard lock (a slow client never holds
        it while it waits), else or then (once the weights moved on) by `sendfile` from the file."""
        offset = 0
        if self.memory is not None and self.guard is not None:
            moved = False
            for view in _pieces(self.memory.body, SEND_PIECE):
                while view and not moved:
                    with self.guard.lock:
                        moved = self.guard.epoch != self.memory.epoch
                        n = 0 if moved else out.write_some(view)
                    if n:
                        view, offset = view[n:], offset + n
                    elif not moved:
                        out.wait()
                if moved:
                    break
            else:
                self._sent_all = True
                return
            self._file = self.files.open_reader(self.path)
        assert self._file is not None
        out.sendfile(self._file.fileno(), offset, self.size - offset)
        self._sent_all = True

    def close(self) -> None:
        if self._file is not None:
            self.files.close_reader(self.path, self._file)
            self._file = None
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self._sent_all)


def _read_chunks(file: BinaryIO, n: int) -> list[bytes]:
    """Up to `n` chunks of the file (fewer at its end): one trip to a worker thread reads
    several, since a hop costs about as much as copying one chunk from the page cache."""
    chunks = []
    for _ in range(n):
        chunk = file.read(CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
    return chunks


def _pieces(body: EncodedBody, size: int) -> Iterator[memoryview]:
    for view in body:
        for start in range(0, view.nbytes, size):
            yield view[start : start + size]


class ModelResponse(StreamingResponse):
    """A model download: written by `ModelStream.pump` straight to the socket where the server
    offers it (`httpbody.SEND`: plain HTTP with our protocol), else streamed in chunks."""

    def __init__(self, stream: ModelStream, headers: dict[str, str]) -> None:
        super().__init__(stream.chunks(), media_type="application/octet-stream", headers=headers)
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sink = scope.get("extensions", {}).get(SEND)
        if sink is None:
            await super().__call__(scope, receive, send)
            return
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await sink.run(self.stream.pump)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnect:
            pass  # the client went away: nothing to answer
        finally:
            self.stream.close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # never started: nothing runs
