"""One model download over P connections at once, each a byte range of the same body
(`transfer.streams` > 1, fast IO's direct path).

The body's head comes first (`Range: bytes=0-…`, its length prefix and header: a few KB): it
names the tensors and where each lies in the body, and the response names the body
(`ETag`, `Content-Range`'s total). Every tensor is then allocated (the caller's `allocate`:
the parameters' own storage) and the data split into P contiguous ranges, each read on a
thread of its own, with `If-Match` the body's ETag (a body that changed meanwhile is a 412:
the download falls back to one stream), straight from its socket into the tensors. A range
whose connection breaks is asked again for its missing rest, a bounded number of times.

The digest covers the body in order, so it is computed once all ranges are in: the head,
then each tensor's bytes, from memory (xxh3 hashes at several GB/s: docs/architecture.md has
the measured cost). A mismatch drops the whole download (the retry loop fetches it again).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx

from fedtrain.errors import WireError
from fedtrain.transport.progress import Progress

if TYPE_CHECKING:
    import torch

    from fedtrain.transport.direct_http import Direct
    from fedtrain.wire.format import TensorSpec

__all__ = ["HEAD_PROBE", "MIN_RANGE", "RANGE_ATTEMPTS", "ParallelDownload", "StreamChooser", "split"]

#: The first request asks for this many bytes: a body's head (length prefix, header) is in it
#: but for a model of tens of thousands of tensors, whose rest of the head is then asked for.
HEAD_PROBE = 64 << 10
#: No range smaller than this: a small body goes over fewer connections.
MIN_RANGE = 4 << 20
#: Requests for the rest of one range before the download gives up (the retry loop then starts over).
RANGE_ATTEMPTS = 4

Request = Callable[[dict[str, str]], Any]  # headers -> a context manager yielding a `Direct`


def split(start: int, stop: int, parts: int, min_size: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) in at most `parts` contiguous ranges of about equal size, none below
    `min_size` (default MIN_RANGE)."""
    n = max(1, min(parts, (stop - start) // max(1, MIN_RANGE if min_size is None else min_size)))
    bounds = [start + (stop - start) * i // n for i in range(n + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


class StreamChooser:
    """`transfer.streams: auto`: the streams of the next download, from the rates of the last ones.

    Starts at one; after a download at P streams that was at least `gain` faster than the best
    at fewer, tries 2P next (up to `most`); once doubling stops paying, it settles on the best P
    seen, and tries the next doubling again every `recheck` downloads (links change). Downloads
    under `min_bytes` say nothing of the link and are not counted. One client's thread uses it."""

    def __init__(self, most: int = 16, gain: float = 1.1, recheck: int = 20, min_bytes: int = 2 * MIN_RANGE) -> None:
        self.most, self.gain, self.recheck, self.min_bytes = most, gain, recheck, min_bytes
        self.rates: dict[int, float] = {}  # streams -> the latest rate measured with them (bytes/s)
        self.best = 1
        self._next = 1
        self._since = 0  # counted downloads since the last probe

    def choose(self) -> int:
        return self._next

    def record(self, streams: int, nbytes: int, seconds: float) -> None:
        """A download at `streams` moved `nbytes` in `seconds`."""
        if nbytes < self.min_bytes or seconds <= 0:
            return
        rate = nbytes / seconds
        if streams != self.best and rate >= self.gain * self.rates.get(self.best, 0.0):
            self.best = streams  # the probe paid
        self.rates[streams] = rate
        self._since += 1
        probe = self.best * 2
        if probe <= self.most and (probe not in self.rates or self._since >= self.recheck):
            self._next, self._since = probe, 0
        else:
            self._next = self.best


class ParallelDownload:
    """One body fetched as byte ranges over `streams` connections; `run` returns (version, tensors)."""

    def __init__(self, request: Request, streams: int,
                 allocate: Callable[[TensorSpec], torch.Tensor] | None,
                 on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None,
                 what: str, refuse: Callable[[Direct], Exception], log: logging.Logger | None = None) -> None:
        self._request, self.streams, self._refuse = request, streams, refuse
        self._allocate, self._on_header, self.what, self._log = allocate, on_header, what, log
        self._lock = threading.Lock()
        self.progress: Progress | None = None

    def run(self) -> tuple[int, dict[str, torch.Tensor]]:
        from fedtrain.wire.digest import StreamingDigest, verify_digest
        from fedtrain.wire.format import PREFIX_BYTES

        head, etag, size, digest, version = self._head()
        order, regions, tensors = self._place(head)
        self.progress = Progress(self.what, size, log=self._log)
        start = PREFIX_BYTES + int.from_bytes(head[:PREFIX_BYTES], "little")
        self.progress.add(start)
        described = start + sum(v.nbytes for v in regions)
        if described != size:
            raise WireError(f"the model body is {size} bytes, its header describes {described}")
        ranges = split(start, size, self.streams)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._range, args=(a, b, start, regions, etag, errors), daemon=True,
                                    name=f"fedtrain-range-{i}") for i, (a, b) in enumerate(ranges)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        state = StreamingDigest.like(digest)
        state.update(head[:start])
        for view in regions:
            state.update(view)
        verify_digest(state.digest(), digest)
        return version, {name: tensors[name] for name in order}

    def _head(self) -> tuple[bytes, str, int, str, int]:
        """The body's length prefix and header (and the names of the body) from ranges of its start."""
        from fedtrain.transport.direct_http import VERSION_HEADER
        from fedtrain.wire.digest import DIGEST_HEADER
        from fedtrain.wire.format import MAX_HEADER_BYTES, PREFIX_BYTES

        head, want, etag, size, digest, version = b"", HEAD_PROBE, None, 0, "", -1
        while True:
            fields = {"Range": f"bytes={len(head)}-{want - 1}", **({"If-Match": etag} if etag else {})}
            with self._request(fields) as r:
                if r.status >= 400:
                    raise self._refuse(r)
                if r.status != 206:
                    raise WireError(f"the coordinator answered a range with {r.status}: it serves no byte ranges")
                etag, digest = r.headers.get("etag"), r.headers.get(DIGEST_HEADER)
                size = int(r.headers.get("content-range", "/0").rsplit("/", 1)[1])
                version = int(r.headers.get(VERSION_HEADER, -1))
                head += _read_all(r, int(r.headers["content-length"]))
            if etag is None or digest is None:
                raise WireError("a model body without an ETag or a digest cannot come in ranges")
            if len(head) >= PREFIX_BYTES:
                n = int.from_bytes(head[:PREFIX_BYTES], "little")
                if not 0 < n <= MAX_HEADER_BYTES:
                    raise WireError(f"tensor body header length {n} is out of bounds")
                if len(head) >= PREFIX_BYTES + n or len(head) >= size:
                    return head, etag, size, digest, version
                want = min(size, PREFIX_BYTES + n)

    def _place(self, head: bytes) -> tuple[list[str], list[memoryview], dict[str, torch.Tensor]]:
        """Every tensor allocated; their byte views in body order."""
        import torch

        from fedtrain.wire.format import PREFIX_BYTES, byte_view, parse_header

        n = int.from_bytes(head[:PREFIX_BYTES], "little")
        specs, metadata = parse_header(bytes(head[PREFIX_BYTES : PREFIX_BYTES + n]))
        if self._on_header is not None:
            self._on_header({s.name: s for s in specs}, dict(metadata))
        tensors: dict[str, torch.Tensor] = {}
        for spec in specs:
            tensors[spec.name] = self._allocate(spec) if self._allocate is not None else \
                torch.empty(spec.shape, dtype=spec.dtype)
        regions = [byte_view(tensors[s.name]) for s in specs if s.nbytes]
        return [s.name for s in specs], regions, tensors

    def _range(self, a: int, b: int, start: int, regions: list[memoryview], etag: str,
               errors: list[BaseException]) -> None:
        """Bytes [a, b) of the body into `regions` (which begin at body offset `start`)."""
        at, attempts = a, 0
        try:
            while at < b:
                attempts += 1
                try:
                    with self._request({"Range": f"bytes={at}-{b - 1}", "If-Match": etag}) as r:
                        if r.status >= 400:
                            raise self._refuse(r)  # 412: the body changed meanwhile (the retry loop starts over)
                        if r.status != 206:
                            raise WireError(f"a range of the model answered {r.status}, not 206")
                        for view in _views(regions, at - start, b - start):
                            while view:
                                got = r.readinto(view)
                                if not got:
                                    raise httpx.ReadError("a range of the model ended early")
                                view, at = view[got:], at + got
                                with self._lock:
                                    assert self.progress is not None
                                    self.progress.add(got)
                except httpx.TransportError:
                    if attempts >= RANGE_ATTEMPTS:
                        raise
                    if self._log is not None:
                        self._log.info("%s: range %d-%d resumes at byte %d", self.what, a, b - 1, at)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)


def _views(regions: list[memoryview], lo: int, hi: int) -> Iterator[memoryview]:
    """The parts of the concatenation of `regions` that cover [lo, hi)."""
    offset = 0
    for view in regions:
        end = offset + view.nbytes
        if end > lo and offset < hi:
            yield view[max(lo, offset) - offset : min(hi, end) - offset]
        offset = end
        if offset >= hi:
            return


def _read_all(r: Direct, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = r.read(n - len(data))
        if not chunk:
            raise httpx.ReadError("the body's head ended early")
        data += chunk
    return data
