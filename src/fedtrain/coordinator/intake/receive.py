"""Receiving an upload's bytes into a spool file handed to it: header checked against the
model before a data byte is accepted, written and hashed on a worker thread batch by batch,
length and digest verified, a plain body scanned for NaN and Inf as it lands; and
`peek_header`, which reads a body's header ahead and hands every byte back. The files
themselves are the spool's (`spool.py`).

More: docs/architecture.md, "coordinator/intake/receive.py".
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fedtrain.errors import WireError
from fedtrain.transport.body import Body
from fedtrain.wire import BodyReader, StreamingDigest, TensorSpec, parse_header
from fedtrain.wire.compress import scheme_of
from fedtrain.wire.digest import parse_digest, verify_digest
from fedtrain.wire.finite import FiniteScan

log = logging.getLogger("fedtrain.coordinator")

# Bytes handed to the writer thread at a time. Each upload has two batch buffers (one being
# written, one being filled), so concurrent uploads add 2 x BATCH each (32 MB at N = 8).
# 2 MiB rather than less keeps the trips to the thread few, at 4 MiB per upload in flight.
BATCH = 2 << 20
_PREFIX = 8


class _SpoolSink:
    """The worker-thread half of a receive: write chunks over the file, hash them and, for a
    plain body, look for NaN and Inf in them (`scan`, set before the first batch)."""

    def __init__(self, path: Path, digest: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # no O_TRUNC: overwrite cached pages
        self.hash = StreamingDigest.like(digest)
        self.written = 0
        self.scan: FiniteScan | None = None

    def take(self, chunks: list[memoryview]) -> None:
        for chunk in chunks:
            self.hash.update(chunk)
            if self.scan is not None:
                self.scan.feed(chunk)
        view_total = sum(len(c) for c in chunks)
        written = os.writev(self.fd, chunks)
        if written != view_total:  # a short write (rare, e.g. a signal): finish it chunk by chunk
            _write_rest(self.fd, chunks, written)
        self.written += view_total

    def close(self) -> None:
        try:
            os.ftruncate(self.fd, self.written)  # drop what a longer earlier upload left behind
        finally:
            os.close(self.fd)


def _write_rest(fd: int, chunks: list[memoryview], done: int) -> None:
    for chunk in chunks:
        if done >= len(chunk):
            done -= len(chunk)
            continue
        view = memoryview(chunk)[done:]
        done = 0
        while view:
            view = view[os.write(fd, view):]


async def receive_to_spool(
    body: Body | AsyncIterator[bytes],
    path: Path,
    *,
    digest: str,
    length: int,
    limit: int,
    on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None],
) -> tuple[BodyReader, FiniteScan | None]:
    """Stream a body into `path`, checking header, length and digest; returns the reader
    (its `specs` and `metadata` describe the body) and, for a plain (uncompressed) body,
    the scan of its values for NaN and Inf made on the way (None: not scanned, e.g. a
    compressed body, or a header longer than a batch). Raises WireError for a bad body;
    the caller disposes of the file (`SpoolFiles.discard`).

    The body is read in batches into two buffers in turn: one is filled from the socket
    while the writer thread hashes, scans and writes the other."""
    parse_digest(digest)  # refuse a malformed digest before reading the body
    body = Body.of(body)
    reader = BodyReader(max_bytes=limit, expected_length=length, on_header=on_header, store_data=False)
    sink = _SpoolSink(path, digest)
    size = max(1, min(BATCH, length + 1))  # one byte more than declared shows a body that is too long
    buffers = [memoryview(bytearray(size)) for _ in range(2)]
    pending: asyncio.Future[None] | None = None
    batches = 0
    try:
        while True:
            buf = buffers[batches % 2]  # the one not being written
            n = await body.readinto(buf)
            if n:
                reader.feed(buf[:n])
                if batches == 0:
                    sink.scan = scan_for(reader)
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(asyncio.to_thread(sink.take, [buf[:n]]))
                batches += 1
            if n < len(buf):
                break
        if pending is not None:
            await pending
            pending = None
        reader.finish()
        verify_digest(sink.hash.digest(), digest)
    finally:
        if pending is not None:  # an error while a batch was being written: let it finish first
            await asyncio.gather(pending, return_exceptions=True)
        sink.close()
    scan = sink.scan if sink.scan is not None and sink.scan.complete else None
    return reader, scan


def scan_for(reader: BodyReader) -> FiniteScan | None:
    """A scan of the body's values from its first byte on, for a plain body whose header is read."""
    if not reader.header_ready or scheme_of(reader.metadata)[0] != "none":
        return None
    return FiniteScan(reader.layout)


Head = tuple[dict[str, TensorSpec], dict[str, str]]
PEEK_LIMIT = 1 << 20  # a header longer than this is not worth a direct receive: the body is spooled


async def peek_header(body: Body | AsyncIterator[bytes]) -> tuple[Head | None, Body]:
    """Read a body's header ahead: (specs and metadata, or None when the head is not a
    header we can read here; the body, whose next read starts at its first byte again).
    The body is not checked: the receive that follows does that, and reports a bad header."""
    body = Body.of(body)
    prefix = await body.read(_PREFIX)
    need = int.from_bytes(prefix, "little") if len(prefix) == _PREFIX else PEEK_LIMIT
    if need > PEEK_LIMIT - _PREFIX:
        body.unread(prefix)
        return None, body
    header = await body.read(need)
    body.unread(prefix + header)
    try:
        order, metadata = parse_header(header)
    except WireError:
        return None, body
    return ({s.name: s for s in order}, metadata), body
