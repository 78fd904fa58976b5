"""Receiving an upload's bytes: stream them to a spool file, verify them, read them back cheaply.

A body is read into memory the coordinator names (`fedtrain.transport.Body.readinto`):
with the fast HTTP protocol the socket is read straight into it, with no copy on the way.

The coordinator never holds an upload in memory of its own. The body is read into two
batch buffers in turn; the event loop only parses the safetensors header (checked against
the model before a data byte is accepted) and counts bytes, while writing the spool file
and hashing the body happen on a worker thread, batch by batch, so the hash (with sha256,
the single largest cost of a receive) overlaps with the network instead of following it.
A body whose length or digest is wrong is refused before anything reads its values.

Once verified, the spool file is read back in 16 MiB pieces, each mapped from the page
cache (where the file's pages still are) and read in place: checking values and folding
cost no allocation, no parse and no copy (a staging buffer would add a `readinto`, a
memcpy, before each add). One piece at a time is mapped, so the coordinator's resident
memory grows by 16 MiB at most.
Spool files are reused from one upload to the next (`SpoolFiles`).

`peek_header` reads a body's header ahead (for the coordinator to choose how to receive
it) and hands every byte back. `UploadsMixin` (`uploads.py`) puts these to use.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from fedtrain.errors import WireError
from fedtrain.transport.body import Body
from fedtrain.wire import BodyReader, StreamingDigest, TensorSpec, parse_header
from fedtrain.wire.compress import decompress, scheme_of
from fedtrain.wire.digest import parse_digest, verify_digest
from fedtrain.wire.finite import FiniteScan

log = logging.getLogger("fedtrain.coordinator")

# Bytes handed to the writer thread at a time. Each upload has two batch buffers (one being
# written, one being filled), so concurrent uploads add 2 x BATCH each (32 MB at N = 8).
# 2 MiB rather than less keeps the trips to the thread few, at 4 MiB per upload in flight.
BATCH = 2 << 20
_PREFIX = 8


class SpoolFiles:
    """Spool files for uploads, reused from one upload to the next.

    Overwriting a file whose pages are in the page cache is about twice as fast as writing a
    fresh one (no page allocation), and there is no unlink to pay: the directory holds one
    file per upload that was ever in flight at once. Used from the event loop only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._free: list[Path] = []
        self._made = 0

    def take(self) -> tuple[Path, bool]:
        """A file to spool the next upload into, and whether it is new."""
        if self._free:
            return self._free.pop(), False
        self._made += 1
        return self.root / f"upload-{self._made}.spool", True

    def give_back(self, path: Path) -> None:
        """Return a file for reuse (one moved away, e.g. kept for a robust aggregator, is not)."""
        if path.exists():
            self._free.append(path)

    def discard(self, path: Path, new: bool) -> None:
        """After a refused upload: its bytes go; the directory is left as the upload found it."""
        if new:
            path.unlink(missing_ok=True)
        elif path.exists():
            os.truncate(path, 0)
            self._free.append(path)


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


PIECE_BYTES = 16 << 20


class Staging:
    """Reads verified spool files back: in mapped pieces of at most `PIECE_BYTES`, or whole.

    A plain (uncompressed) body is read in pieces of whole elements, so checking and folding
    an upload map 16 MiB, not its largest tensor (an LLM's embedding can be a GB). A
    compressed body is decoded a whole tensor at a time, into fresh memory."""

    def __init__(self, nbytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = max(nbytes, 64)
        self._buffer: torch.Tensor | None = None  # where pieces are read when mapping fails

    def header(self, path: Path) -> tuple[list[TensorSpec], dict[str, str]]:
        with open(path, "rb") as f:
            return _read_header(f)

    def pieces(self, path: Path) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, index of its first element, values) of a verified spool file, in file
        order; each piece is a flat view of the file's pages, mapped (copy on write: the
        file never changes), and unmapped once the caller lets go of it. Where the file
        cannot be mapped (a file system without mmap) pieces are read into one buffer
        instead, each valid until the next."""
        with open(path, "rb", buffering=0) as f:
            order, _ = _read_header(f)
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
            for spec in order:
                if offset + spec.nbytes > size:  # a mapped page past the end would be a SIGBUS, not an error
                    raise WireError(f"spool file ended inside tensor {spec.name!r}")
                per_piece = max(1, self.piece_bytes // spec.dtype.itemsize)
                if spec.numel == 0:
                    yield spec.name, 0, torch.empty(0, dtype=spec.dtype)
                for start in range(0, spec.numel, per_piece):
                    nbytes = min(per_piece, spec.numel - start) * spec.dtype.itemsize
                    yield spec.name, start, self._piece(f, offset, nbytes, spec.name).view(spec.dtype)
                    offset += nbytes

    def _piece(self, f: BinaryIO, offset: int, nbytes: int, name: str) -> torch.Tensor:
        if self._buffer is None:
            try:
                return _mapped(f.fileno(), offset, nbytes)
            except (OSError, ValueError) as e:
                log.warning("spool files cannot be mapped here (%s); reading them back through a buffer", e)
                self._buffer = torch.empty(self.piece_bytes, dtype=torch.uint8)
        piece = self._buffer[:nbytes]
        f.seek(offset)
        _readinto(f, memoryview(piece.numpy()), name)  # type: ignore[arg-type]
        return piece

    def tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of a verified spool file, each read whole into fresh memory."""
        with open(path, "rb", buffering=0) as f:
            order, _ = _read_header(f)
            for spec in order:
                t = torch.empty(spec.shape, dtype=spec.dtype)
                if spec.nbytes:
                    _readinto(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()), spec.name)  # type: ignore[arg-type]
                yield spec.name, t

    def decoded(self, path: Path, dtypes: Mapping[str, torch.dtype],
                metadata: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors of a verified spool file (compressed bodies decoded), one at a time;
        pass the header's `metadata` when it was read already."""
        meta = self.header(path)[1] if metadata is None else metadata
        return decompress(self.tensors(path), meta, dtypes)


def _mapped(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of a file as a tensor over its mapped pages; the mapping
    lives as long as the tensor does."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset - start)


def _read_header(f: object) -> tuple[list[TensorSpec], dict[str, str]]:
    n = int.from_bytes(_read_exact(f, _PREFIX), "little")
    return parse_header(_read_exact(f, n))


def _readinto(f: object, view: memoryview, name: str) -> None:
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise WireError(f"spool file ended inside tensor {name!r}")
        got += n


def _read_exact(f: object, n: int) -> bytes:
    data = f.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise WireError("spool file is truncated")
    return data


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
