"""Content digests of tensor bodies: the "<algorithm>:<hex>" strings sent beside each body.

A digest covers the exact bytes of a body (length prefix, header, data). It travels
separately from the body (the `X-Fedtrain-Digest` HTTP header, a column in the store) so a
receiver can refuse a corrupted or truncated body before it is used.

Two algorithms are accepted, and the digest names its own, so a receiver checks whatever a
sender chose: "xxh3-128" (the default: xxHash's XXH3, 128 bits) and "sha256". The digest
guards against corruption and truncation, not against an attacker: it travels in the same
request as the body, so whoever could alter the body could recompute any unkeyed hash too;
TLS and the bearer tokens are what keep bodies authentic. For that job a 128-bit
non-cryptographic hash is as good as sha256 and ten times cheaper, and with sha256 the hash
is the largest per-byte cost of a sync. The run config's `digest` picks the algorithm the
coordinator and its participants write. An unknown algorithm is refused
rather than skipped, so a typo can never turn the check off.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from fedtrain.errors import WireError

DIGEST_HEADER = "X-Fedtrain-Digest"
DIGEST_ALGORITHM = "xxh3-128"

_HASHES: dict[str, Callable[[], Any]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_HEX_LENGTH = {"xxh3-128": 32, "sha256": 64}
ALGORITHMS = tuple(_HASHES)
_DIGEST_RE = re.compile(r"^([a-z0-9-]+):([0-9a-f]+)$")

Buffer = bytes | bytearray | memoryview


def format_digest(hexdigest: str, algorithm: str = DIGEST_ALGORITHM) -> str:
    """Join an algorithm and a hex digest into the wire form "<algorithm>:<hex>"."""
    return f"{algorithm}:{hexdigest}"


def parse_digest(value: str) -> tuple[str, str]:
    """Split "<algorithm>:<hex>" into (algorithm, hex); refuse anything else with WireError."""
    if not isinstance(value, str):
        raise WireError(f"a body digest must be a string like 'xxh3-128:<32 hex digits>', not {type(value).__name__}")
    match = _DIGEST_RE.match(value.strip().lower())
    if match is None:
        raise WireError(f"malformed body digest {value!r}: expected '<algorithm>:<hex digits>', "
                        f"with algorithm one of {', '.join(ALGORITHMS)}")
    algorithm, hexdigest = match.groups()
    check_algorithm(algorithm, f" in {value!r}")
    if len(hexdigest) != _HEX_LENGTH[algorithm]:
        raise WireError(
            f"malformed body digest {value!r}: {algorithm} needs "
            f"{_HEX_LENGTH[algorithm]} hex digits, got {len(hexdigest)}"
        )
    return algorithm, hexdigest


def check_algorithm(algorithm: str, where: str = "") -> str:
    if algorithm not in _HASHES:
        raise WireError(f"unsupported digest algorithm {algorithm!r}{where}: accepted are {', '.join(ALGORITHMS)}")
    return algorithm


def digests_equal(a: str, b: str) -> bool:
    """Compare two digest strings in constant time after normalizing them."""
    return hmac.compare_digest(_normalize(a), _normalize(b))


def verify_digest(got: str, expected: str) -> None:
    """Refuse a body whose digest `got` is not the `expected` one, with the one message."""
    if not digests_equal(got, expected):
        raise WireError(
            f"body digest mismatch: expected {expected}, got {got}; the body was corrupted in transit, send it again"
        )


def _normalize(value: str) -> str:
    algorithm, hexdigest = parse_digest(value)
    return format_digest(hexdigest, algorithm)


class StreamingDigest:
    """A digest fed chunk by chunk; `update` takes memoryviews without copying them.

    Both hashes release the GIL for large buffers, so hashing a large chunk lets other
    threads (the network, the event loop's executor) run meanwhile.
    """

    __slots__ = ("_hash", "algorithm", "nbytes")

    def __init__(self, algorithm: str | None = None) -> None:
        self.algorithm = check_algorithm(algorithm or DIGEST_ALGORITHM)
        self._hash = _HASHES[self.algorithm]()
        self.nbytes = 0

    @classmethod
    def like(cls, expected: str) -> StreamingDigest:
        """A digest of the algorithm `expected` names (to check a body against it)."""
        return cls(parse_digest(expected)[0])

    def update(self, data: Buffer) -> None:
        self._hash.update(data)
        self.nbytes += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())

    def digest(self) -> str:
        """The wire form "<algorithm>:<hex>" of everything fed so far."""
        return format_digest(self.hexdigest(), self.algorithm)


def digest_bytes(data: Buffer, algorithm: str | None = None) -> str:
    """The wire digest of one in-memory buffer."""
    state = StreamingDigest(algorithm)
    state.update(data)
    return state.digest()


def digest_chunks(chunks: Iterable[Buffer], algorithm: str | None = None) -> str:
    """The wire digest of a stream of chunks, e.g. `digest_chunks(iter_file(path))`."""
    state = StreamingDigest(algorithm)
    for chunk in chunks:
        state.update(chunk)
    return state.digest()


class BackgroundDigest:
    """A StreamingDigest fed on a worker thread, so hashing overlaps with receiving.

    `update` gathers chunks and hands them over in batches of about `batch` bytes; at most
    one batch is being hashed while the next one is gathered, so the memory held is about
    two batches. The chunks must not be modified after `update` (bytes from a socket are
    not). `digest` waits for the last batch."""

    def __init__(self, algorithm: str | None = None, batch: int = 1 << 20) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._state = StreamingDigest(algorithm)
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
