"""Receiving an upload: stream it to a spool file, verify it, read it back cheaply.

The coordinator never holds an upload in memory. While the body streams in, the event
loop only parses the safetensors header (checked against the model before a data byte is
accepted) and counts bytes; writing the spool file and hashing the body happen on a
worker thread, batch by batch, so the hash (with sha256, the single largest cost of a
receive) overlaps with the network instead of following it. A body whose length or digest is
wrong is refused before anything reads its values.

Once verified, the spool file is read back tensor by tensor with `readinto` into one
staging buffer that the coordinator keeps (the size of the model's largest tensor), so
checking values and folding cost no allocation and no parse: the file's pages are still
in the page cache, and one `readinto` is a memcpy. The staging buffer is shared, so its
users hold the coordinator's fold lock.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import torch

from fedtrain import faults
from fedtrain.errors import WireError
from fedtrain.wire import BodyReader, StreamingDigest, TensorSpec, digests_equal, parse_header
from fedtrain.wire.compress import SCALE_SUFFIX, decompress
from fedtrain.wire.digest import parse_digest

# Bytes handed to the writer thread at a time. Two batches are in flight per upload at
# most (one being written, one being gathered), so concurrent uploads add 2 x BATCH each.
BATCH = 512 << 10
_PREFIX = 8


class _SpoolSink:
    """The worker-thread half of a receive: append chunks to the file and hash them."""

    def __init__(self, path: Path, digest: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.hash = StreamingDigest.like(digest)

    def take(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            self.hash.update(chunk)
        view_total = sum(len(c) for c in chunks)
        written = os.writev(self.fd, chunks)
        if written != view_total:  # a short write (rare, e.g. a signal): finish it chunk by chunk
            _write_rest(self.fd, chunks, written)

    def close(self) -> None:
        os.close(self.fd)


def _write_rest(fd: int, chunks: list[bytes], done: int) -> None:
    for chunk in chunks:
        if done >= len(chunk):
            done -= len(chunk)
            continue
        view = memoryview(chunk)[done:]
        done = 0
        while view:
            view = view[os.write(fd, view):]


async def receive_to_spool(
    chunks: AsyncIterator[bytes],
    path: Path,
    *,
    digest: str,
    length: int,
    limit: int,
    on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None],
    who: str | None = None,
    round_: int | None = None,
) -> BodyReader:
    """Stream a body into `path`, checking header, length and digest; returns the reader
    (its `specs` and `metadata` describe the body). Raises WireError for a bad body; the
    caller removes the file."""
    parse_digest(digest)  # refuse a malformed digest before reading the body
    reader = BodyReader(max_bytes=limit, expected_length=length, on_header=on_header, store_data=False)
    sink = _SpoolSink(path, digest)
    pending: asyncio.Future[None] | None = None
    batch: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            if not chunk:
                continue
            if reader.bytes_received == 0:
                faults.hit("upload.streaming", who=who, round=round_)
            reader.feed(chunk)
            batch.append(chunk)
            size += len(chunk)
            if size >= BATCH:
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(asyncio.to_thread(sink.take, batch))
                batch, size = [], 0
        if pending is not None:
            await pending
            pending = None
        if batch:
            await asyncio.to_thread(sink.take, batch)
        reader.finish()
        got = sink.hash.digest()
        if not digests_equal(got, digest):
            raise WireError(
                f"body digest mismatch: expected {digest}, got {got}; the body was corrupted in transit, send it again"
            )
    finally:
        if pending is not None:  # an error while a batch was being written: let it finish first
            await asyncio.gather(pending, return_exceptions=True)
        sink.close()
    return reader


class Staging:
    """One reusable buffer for reading verified spool files back, tensor by tensor."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self._bytes = memoryview(self.buffer.numpy())  # type: ignore[arg-type]

    def tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of a verified spool file; each tensor is a view of the buffer,
        valid until the next one is read (int8 scales, needed beside their tensor, are copied)."""
        with open(path, "rb", buffering=0) as f:
            n = int.from_bytes(_read_exact(f, _PREFIX), "little")
            order, _ = parse_header(_read_exact(f, n))
            for spec in order:
                yield spec.name, self._read(f, spec)

    def _read(self, f: object, spec: TensorSpec) -> torch.Tensor:
        nbytes = spec.nbytes
        if nbytes > self.buffer.numel():  # cannot happen for a body checked against the model
            raise WireError(f"tensor {spec.name!r} is larger than the model's largest tensor")
        view = self._bytes[:nbytes]
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                raise WireError(f"spool file ended inside tensor {spec.name!r}")
            got += n
        t = self.buffer[:nbytes].view(spec.dtype).view(spec.shape)
        return t.clone() if spec.name.endswith(SCALE_SUFFIX) else t

    def decoded(self, path: Path, dtypes: Mapping[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors of a verified spool file (compressed bodies decoded), one at a time."""
        meta: dict[str, str] = {}
        with open(path, "rb") as f:
            n = int.from_bytes(_read_exact(f, _PREFIX), "little")
            meta.update(parse_header(_read_exact(f, n))[1])
        return decompress(self.tensors(path), meta, dtypes)


def _read_exact(f: object, n: int) -> bytes:
    data = f.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise WireError("spool file is truncated")
    return data


def largest_tensor_bytes(spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes of the model's largest tensor (a compressed body's tensors are never larger)."""
    out = 0
    for dtype, shape in spec.values():
        numel = 1
        for d in shape:
            numel *= d
        out = max(out, numel * dtype.itemsize)
    return out


async def drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what is left of a request body, so that the client receives our answer."""
    try:
        async for _ in chunks:
            pass
    except Exception:  # noqa: BLE001 - a client gone away is not our error to report
        pass
