"""The plain path's adapter for a download's body: its steps taken on the event loop, the bytes
handed out a chunk at a time to a streaming response.

A download has one body producer, its `steps(out)` (`coordinator/model/publish.py`,
`slices.py`): written straight to the socket from a worker thread where the server offers it
(`send.py`, fast IO on), or through `ChunkSender` here and `chunks_of`, where it does not.

More: docs/architecture.md, "transport/chunks.py".
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Generic, Protocol, TypeVar

from fedtrain.transport.protocols import Hold, ModelSender, Steps

__all__ = ["CHUNK", "READS_PER_HOP", "SLOW_READ_S", "ChunkSender", "Work", "chunks_of", "read_chunks"]

# Below the coordinator's mmap threshold (1 MiB, see `transport.allocator.tune_allocator`): chunks come from
# the heap and are reused, where a chunk above it would be a fresh mmap whose page faults and
# munmap cost more than the copy.
CHUNK = 512 << 10
READS_PER_HOP = 8
SLOW_READ_S = 0.005

T = TypeVar("T")


class Body(Protocol):
    """What `chunks_of` sends: a download's steps through a sender, and its close."""

    def steps(self, out: ModelSender) -> Steps: ...

    def close(self) -> None: ...


def read_chunks(fd: int, offset: int, end: int, n: int) -> list[bytes]:
    """Up to `n` chunks of the file from `offset` (none past `end`): one trip to a worker thread
    reads several, since a hop costs about as much as copying one chunk from the page cache."""
    chunks: list[bytes] = []
    while len(chunks) < n and offset < end:
        chunk = os.pread(fd, min(CHUNK, end - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return chunks


class Work(Generic[T]):
    """A `Hold` that does a piece of blocking work (a read from disk) before the steps go on: on
    the pump's thread when the steps run on one, else on a worker thread (`wait_async`)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._result: T | None = None
        self._done = False

    @property
    def result(self) -> T:
        assert self._done, "the steps go on only once the work is done"
        return self._result  # type: ignore[return-value]

    def wait(self, cancelled: threading.Event) -> None:
        if not self._done:
            self._result, self._done = self._fn(), True

    async def wait_async(self) -> None:
        if not self._done:
            self._result, self._done = await asyncio.to_thread(self._fn), True


class ChunkSender:
    """The plain path's `ModelSender`: what the steps write is handed to a `StreamingResponse`
    a chunk at a time (`chunks_of`). A file is read, not sent: from the page cache (a file
    read recently) in the event loop, since a hop to a worker thread per batch of reads costs
    more than the reads; after one read slower than SLOW_READ_S (a disk's: a checkpoint
    written with O_DIRECT is not in the page cache) the rest on a worker thread, so the loop
    waits on the disk once: the steps yield that read as a `Work` for the adapter to do."""

    def __init__(self) -> None:
        self.ready: list[bytes] = []
        self.sent = 0  # handed to the response (each step's chunks go out before the next step)

    def write_some(self, view: memoryview) -> int:
        if self.ready:  # the last chunk is not handed out yet: the steps yield, and it is
            return 0
        data = bytes(view[:CHUNK])
        self.ready.append(data)
        self.sent += len(data)
        return len(data)

    def sendfile_steps(self, fd: int, offset: int, count: int) -> Iterator[Hold | None]:
        end, slow = offset + count, False
        while offset < end:
            if slow:
                read = Work(partial(read_chunks, fd, offset, end, READS_PER_HOP))
                yield read  # done by the adapter (`chunks_of`: on a worker thread; `run`: here)
                chunks = read.result
            else:
                t0 = time.perf_counter()
                chunks = [os.pread(fd, min(CHUNK, end - offset), offset)]
                slow = time.perf_counter() - t0 > SLOW_READ_S
            chunks = [c for c in chunks if c]
            if not chunks:
                return  # the file ended early: the response falls short of its length, as it would have
            self.ready.extend(chunks)
            n = sum(len(c) for c in chunks)
            offset, self.sent = offset + n, self.sent + n
            yield None

    def run(self, steps: Iterator[Hold | None]) -> None:
        """Take the steps to their end on this thread; the chunks pile up in `ready`."""
        never = threading.Event()
        for hold in steps:
            if hold is not None:
                hold.wait(never)


async def chunks_of(stream: Body) -> AsyncIterator[bytes]:
    """The plain path's adapter: a download's steps (its one body producer) taken on the event
    loop, their bytes handed out a chunk at a time, their waits (a commit, a read on a worker
    thread) awaited on the loop. Closes the stream at the end."""
    out = ChunkSender()
    steps = stream.steps(out)
    try:
        for wait in steps:
            while out.ready:
                yield out.ready.pop(0)
            if wait is not None:
                await wait.wait_async()
        while out.ready:
            yield out.ready.pop(0)
    finally:
        steps.close()
        stream.close()
