"""Request and response bodies for the unit tests of the receive and publish paths: a body fed
in chunks, a safetensors body with raw UTF-8 metadata, a model stream collected or pumped
through a socket pair."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator

import torch

from fedtrain.coordinator.members.auth import ADMIN, Identity
from fedtrain.coordinator.model.publish import ModelStream
from fedtrain.transport.chunks import chunks_of
from fedtrain.transport.send import SocketOut
from fedtrain.wire.digest import digest_bytes
from fedtrain.wire.format import DTYPE_TO_ST


async def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def raw_body(t: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> tuple[bytes, str]:
    """A safetensors body whose header keeps non-ASCII metadata as raw UTF-8 (EncodedBody escapes it)."""
    header: dict = {"__metadata__": meta} if meta else {}
    offset, data = 0, b""
    for name, v in t.items():
        raw = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPE_TO_ST[v.dtype], "shape": list(v.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)
    body = len(head).to_bytes(8, "little") + head + data
    return body, digest_bytes(body)


ADMIN_ID = Identity(ADMIN, "admin")


def collect(stream: ModelStream, between=None) -> bytes:
    async def run() -> bytes:
        out = []
        async for chunk in chunks_of(stream):
            out.append(chunk)
            if between is not None:
                between(len(out))
        return b"".join(out)

    return asyncio.run(run())


def pumped(stream: ModelStream, between=None, *, read: bool = True) -> bytes:
    """What `ModelStream.pump` sends through one end of a socket pair, read at the other;
    `between(n)` runs after every read of the reader (n: bytes so far)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # many small reads
    got = bytearray()

    def reader() -> None:
        while data := b.recv(1 << 16):
            got.extend(data)
            if between is not None:
                between(len(got))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        stream.pump(SocketOut(a.fileno()))
    finally:
        a.close()
        thread.join(timeout=30)
        b.close()
        stream.close()
    return bytes(got)
