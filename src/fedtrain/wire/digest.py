"""Content digests of tensor bodies: the "sha256:<hex>" strings sent beside each body.

A digest covers the exact bytes of a body (length prefix, header, data). It travels
separately from the body (the `X-Fedtrain-Digest` HTTP header, a column in the store) so a
receiver can refuse a corrupted or truncated body before it is used. Only sha256 is
accepted; an unknown algorithm is refused rather than skipped, so a typo can never turn
the check off.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Any

from fedtrain.errors import WireError

DIGEST_HEADER = "X-Fedtrain-Digest"
DIGEST_ALGORITHM = "sha256"

_HEX_LENGTH = {"sha256": 64}
_DIGEST_RE = re.compile(r"^([a-z0-9-]+):([0-9a-f]+)$")

Buffer = bytes | bytearray | memoryview


def format_digest(hexdigest: str, algorithm: str = DIGEST_ALGORITHM) -> str:
    """Join an algorithm and a hex digest into the wire form "sha256:<hex>"."""
    return f"{algorithm}:{hexdigest}"


def parse_digest(value: str) -> tuple[str, str]:
    """Split "sha256:<hex>" into (algorithm, hex); refuse anything else with WireError."""
    if not isinstance(value, str):
        raise WireError(f"a body digest must be a string like 'sha256:<64 hex digits>', not {type(value).__name__}")
    match = _DIGEST_RE.match(value.strip().lower())
    if match is None:
        raise WireError(f"malformed body digest {value!r}: expected 'sha256:<64 hex digits>'")
    algorithm, hexdigest = match.groups()
    if algorithm not in _HEX_LENGTH:
        raise WireError(
            f"unsupported digest algorithm {algorithm!r} in {value!r}: only {DIGEST_ALGORITHM!r} is accepted"
        )
    if len(hexdigest) != _HEX_LENGTH[algorithm]:
        raise WireError(
            f"malformed body digest {value!r}: {algorithm} needs "
            f"{_HEX_LENGTH[algorithm]} hex digits, got {len(hexdigest)}"
        )
    return algorithm, hexdigest


def digests_equal(a: str, b: str) -> bool:
    """Compare two digest strings in constant time after normalizing them."""
    return hmac.compare_digest(_normalize(a), _normalize(b))


def _normalize(value: str) -> str:
    algorithm, hexdigest = parse_digest(value)
    return format_digest(hexdigest, algorithm)


class StreamingDigest:
    """sha256 fed chunk by chunk; `update` takes memoryviews without copying them.

    hashlib releases the GIL for buffers over 2 KiB, so hashing a large chunk lets other
    threads (the network, the event loop's executor) run meanwhile.
    """

    __slots__ = ("_hash", "nbytes")

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def update(self, data: Buffer) -> None:
        self._hash.update(data)
        self.nbytes += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def digest(self) -> str:
        """The wire form "sha256:<hex>" of everything fed so far."""
        return format_digest(self._hash.hexdigest())


def digest_bytes(data: Buffer) -> str:
    """The wire digest of one in-memory buffer."""
    return format_digest(hashlib.sha256(data).hexdigest())


def digest_chunks(chunks: Iterable[Buffer]) -> str:
    """The wire digest of a stream of chunks, e.g. `digest_chunks(iter_file(path))`."""
    state = StreamingDigest()
    for chunk in chunks:
        state.update(chunk)
    return state.digest()


class BackgroundDigest:
    """A StreamingDigest fed on a worker thread, so hashing overlaps with receiving.

    `update` gathers chunks and hands them over in batches of about `batch` bytes; at most
    one batch is being hashed while the next one is gathered, so the memory held is about
    two batches. The chunks must not be modified after `update` (bytes from a socket are
    not). `digest` waits for the last batch."""

    def __init__(self, batch: int = 1 << 20) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._state = StreamingDigest()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-hash")
        self._pending: Any = None
        self._batch: list[Buffer] = []
        self._size = 0
        self._limit = batch

    def update(self, chunk: Buffer) -> None:
        self._batch.append(chunk)
        self._size += memoryview(chunk).nbytes
        if self._size >= self._limit:
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None:
            self._pending.result()
        batch, self._batch, self._size = self._batch, [], 0
        self._pending = self._pool.submit(self._hash, batch)

    def _hash(self, batch: list[Buffer]) -> None:
        for chunk in batch:
            self._state.update(chunk)

    def digest(self) -> str:
        self._flush()
        self._pending.result()
        self.close()
        return self._state.digest()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
