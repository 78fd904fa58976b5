"""The bytes of an upload in parts on disk (`parts.py` owns the sessions): a part written at
its offset in the session's file and hashed as it lands (`write_part`), the contiguous prefix
of held parts read back as it grows (`held_body`, what the intake's reader consumes), and the
whole file read (`file_chunks`). Coroutines on the event loop; the reads, writes and hashes run
on worker threads.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from fedtrain.errors import WireError
from fedtrain.transport.body import Abandoned, Body
from fedtrain.wire.digest import StreamingDigest

#: Bytes read from the socket, hashed and written at a time (and read back at a time).
BATCH = 2 << 20


class Held(Protocol):
    """What `held_body` reads of a session (`parts.Session`)."""

    path: Path
    gone: bool  # dropped
    assembling: bool  # complete: its file stays until its reader has ended
    changed: asyncio.Event  # set (and replaced) at each part held, and at the drop

    @property
    def total(self) -> int: ...

    def prefix_bytes(self) -> int: ...


async def held_body(session: Held) -> AsyncIterator[memoryview]:
    """`session`'s body from its first byte as its parts are held: the contiguous prefix held
    so far, read from its file in BATCH chunks on a worker thread, then a wait for the next
    part; never a byte past the prefix. Raises `Abandoned` once the session is dropped (and
    yields nothing read after: its file goes at the drop, `PartSessions._release_if_unused`).

    Chunks are read into two buffers in turn, each yielded as a view: a `Body` copies a chunk
    out (or keeps what it did not take ahead) before it asks for the next one, so a buffer is
    read again only once the chunk before the last is used up. A reader waiting for a part
    holds no buffer (they are made again once it comes: twice a part, not twice a chunk)."""
    at, total = 0, session.total
    buffers: list[bytearray] = []
    turn = 0
    while at < total:
        changed = session.changed
        if session.gone and not session.assembling:
            raise Abandoned()
        held = session.prefix_bytes()
        if at >= held:
            buffers = []
            await changed.wait()
            continue
        if not buffers:
            buffers = [bytearray(min(BATCH, total)) for _ in range(2)]
        view = memoryview(buffers[turn % 2])[: min(BATCH, held - at)]
        try:
            n = await asyncio.to_thread(_read_at, session.path, at, view)
        except OSError:
            if session.gone:  # (its file went with it)
                raise Abandoned() from None
            raise
        if session.gone and not session.assembling:  # dropped meanwhile: the file may hold other bytes now
            raise Abandoned()
        if not n:
            raise WireError("an upload's spool file is shorter than its parts")
        at, turn = at + n, turn + 1
        yield view[:n]


def _read_at(path: Path, offset: int, view: memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        return os.preadv(f.fileno(), [view], offset)


def size_file(path: Path, total: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, total)
    finally:
        os.close(fd)


async def write_part(body: Body, path: Path, offset: int, length: int, digest: str) -> str:
    """Stream `length` bytes of `body` into `path` at `offset`, hashing them; their digest.
    A body shorter or longer than `length` is a WireError."""
    hasher = StreamingDigest.like(digest)
    fd = await asyncio.to_thread(os.open, path, os.O_WRONLY | os.O_CREAT, 0o600)  # (perhaps before it is sized)
    try:
        buffers = [memoryview(bytearray(min(BATCH, length + 1))) for _ in range(2)]
        pending: asyncio.Future[None] | None = None
        done, turn = 0, 0
        try:
            while True:
                buf = buffers[turn % 2]
                n = await body.readinto(buf)
                if done + n > length:
                    raise WireError(f"the part is longer than its {length:,} bytes")
                if n:
                    if pending is not None:
                        await pending
                    pending = asyncio.ensure_future(asyncio.to_thread(_hash_write, hasher, fd, buf[:n], offset + done))
                    done, turn = done + n, turn + 1
                if n < len(buf):
                    break
            if pending is not None:
                await pending
                pending = None
        finally:
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)
        if done != length:
            raise WireError(f"the part ended after {done:,} of its {length:,} bytes")
        return hasher.digest()
    finally:
        os.close(fd)


def _hash_write(hasher: StreamingDigest, fd: int, view: memoryview, offset: int) -> None:
    hasher.update(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


async def file_chunks(path: Path, total: int) -> Any:
    """The first `total` bytes of `path`, in BATCH chunks read on a worker thread."""
    f = await asyncio.to_thread(open, path, "rb", buffering=0)
    try:
        left = total
        while left:
            chunk = await asyncio.to_thread(f.read, min(BATCH, left))
            if not chunk:
                raise WireError("an upload's spool file is shorter than its parts")
            left -= len(chunk)
            yield chunk
    finally:
        f.close()
