"""Byte ranges of a download (RFC 9110 §14): which part of a body a request asks for, and a
`ModelSender` that lets only that part through.

A body is named by its strong validator, the `ETag` (`etag_of`: the digest of the exact bytes
served, so a whole model, a slice of its rows and any other variant each have their own). A
request asks for one range (`Range: bytes=a-b`, `bytes=a-`, `bytes=-n`), conditionally
(`If-Range: <etag>`: the range if the body is still that one, else the whole body, 200) or
hard (`If-Match: <etag>`: 412 when it is not). `decide` turns the headers into what to send;
`Window` wraps the sender a body's producer writes through, so a producer (`ModelStream`,
`SliceStream`, a compressed delta) never learns that only a part of it goes out: bytes before
the range are skipped without a copy (a file's by moving the `sendfile` offset), and the steps
end once the range is out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from fedtrain.errors import Refused
from fedtrain.transport.protocols import Hold, ModelSender, Steps

__all__ = ["MAX_RANGE_CHARS", "Ranged", "Span", "Window", "decide", "etag_of"]

#: The longest Range / If-Range / If-Match header read (one range of two 20-digit numbers, or
#: a few validators); longer is refused, never parsed.
MAX_RANGE_CHARS = 256
_SPEC = re.compile(r"^(\d{0,20})-(\d{0,20})$")


def etag_of(digest: str) -> str:
    """The strong validator of a body whose digest is `digest` (RFC 9110 §8.8.3: quoted)."""
    return f'"{digest}"'


@dataclass(frozen=True)
class Span:
    """What one response sends of a body of `size` bytes: [start, stop); `partial`: as the
    answer to a Range (206, even when that range is the whole body)."""

    start: int
    stop: int
    size: int
    partial: bool = True

    @property
    def length(self) -> int:
        return self.stop - self.start

    def content_range(self) -> str:
        return f"bytes {self.start}-{self.stop - 1}/{self.size}"


def _unsatisfiable(size: int, code: str, message: str) -> Refused:
    return Refused(416, code, message, {"size": size, "content_range": f"bytes */{size}"})


def _validators(header: str) -> list[str]:
    return [v.strip() for v in header.split(",") if v.strip()]


def decide(size: int, etag: str, range_: str | None, if_range: str | None, if_match: str | None) -> Span:
    """The part of a body (`size` bytes, validator `etag`) to send for these request headers.

    `If-Match` not naming `etag` (nor "*"): 412. A `Range` in another unit than bytes, or with an
    `If-Range` other than `etag` (a stale validator, or a date: these bodies have none), is
    ignored: the whole body (RFC 9110 §13.1.5, §14.2). One range per request (no multipart):
    more, a range that is not `a-b`, `a-` or `-n`, or one that starts past the end: 416."""
    if if_match is not None and "*" not in _validators(if_match) and etag not in _validators(if_match):
        raise Refused(412, "precondition_failed", "If-Match names another version of this body than the one served "
                      f"now ({etag})", {"etag": etag})
    whole = Span(0, size, size, partial=False)
    if range_ is None or (if_range is not None and if_range.strip() != etag):
        return whole
    unit, _, specs = range_.strip().partition("=")
    if unit.strip().lower() != "bytes":
        return whole  # a unit we do not know: MUST be ignored
    parts = [p.strip() for p in specs.split(",") if p.strip()]
    if len(parts) != 1:
        raise _unsatisfiable(size, "too_many_ranges", f"one byte range per request, not {len(parts)}: ask again "
                             "for each (this server sends no multipart bodies)")
    match = _SPEC.match(parts[0])
    if match is None or not any(match.groups()):
        raise _unsatisfiable(size, "invalid_range", f"Range {parts[0][:40]!r} is not bytes=<first>-<last>, "
                             "bytes=<first>- or bytes=-<suffix length> (decimal, at most 20 digits)")
    first, last = match.groups()
    if not first:  # the last `last` bytes
        n = int(last)
        if n == 0 or size == 0:
            raise _unsatisfiable(size, "range_not_satisfiable", f"a suffix of {n} bytes of a {size}-byte body")
        return Span(max(0, size - n), size, size)
    start = int(first)
    if last and int(last) < start:
        raise _unsatisfiable(size, "invalid_range", f"Range bytes={start}-{last} ends before it starts")
    if start >= size:
        raise _unsatisfiable(size, "range_not_satisfiable", f"the range starts at byte {start}, past the end of "
                             f"this {size}-byte body")
    stop = size if not last else min(size, int(last) + 1)
    return Span(start, stop, size)


class _Full(Exception):
    """The window has let its last byte through: the producer's steps end here."""


class Window:
    """A `ModelSender` that passes on bytes [start, stop) of what a producer writes through it,
    counting the producer's bytes from 0; the rest is taken and dropped without a copy."""

    #: A file's range is sent in pieces of at most this many bytes, so that `sent` hears of it as it goes.
    FILE_PIECE = 8 << 20

    def __init__(self, out: ModelSender, span: Span, sent: Callable[[int], None] | None = None) -> None:
        self.out, self.start, self.stop = out, span.start, span.stop
        self.at = 0  # the producer's position in the body
        self.sent = 0  # bytes of the range passed on
        self._sent = sent

    def _count(self, n: int) -> None:
        self.sent += n
        if n and self._sent is not None:
            self._sent(n)

    def write_some(self, view: memoryview) -> int:
        if self.at < self.start:  # skipped: taken whole up to the range's start
            n = min(view.nbytes, self.start - self.at)
            self.at += n
            return n
        if self.at >= self.stop:
            raise _Full
        n = self.out.write_some(view[: self.stop - self.at])
        self.at += n
        self._count(n)
        if self.at >= self.stop:
            raise _Full
        return n

    def sendfile_steps(self, fd: int, offset: int, count: int) -> Iterator[Hold | None]:
        begin, end = self.at, self.at + count
        lo, hi = max(begin, self.start), min(end, self.stop)
        at = offset + (lo - begin)
        while lo < hi:
            n = min(hi - lo, self.FILE_PIECE)
            was = self.out.sent
            try:
                yield from self.out.sendfile_steps(fd, at, n)
            finally:  # what went of the piece, all of it or up to a cut
                self._count(self.out.sent - was)
            lo, at = lo + n, at + n
        self.at = end
        if self.at >= self.stop:
            raise _Full

    def run(self, steps: Iterator[Hold | None]) -> None:
        self.out.run(steps)

    def steps(self, inner: Steps) -> Steps:
        """`inner` (a producer's steps through this window), ended once the range is out."""
        try:
            yield from inner
        except _Full:
            return
        finally:
            inner.close()


class _Body(Protocol):
    """What `Ranged` narrows: the `publish.Download` Protocol (transport imports no coordinator module)."""

    def steps(self, out: ModelSender) -> Steps: ...

    def close(self) -> None: ...


class Ranged:
    """A download (`publish.Download`) sending only `span` of its body; `sent` hears of its bytes
    as they go, `done` once when it ends (sent or not)."""

    def __init__(self, stream: _Body, span: Span, sent: Callable[[int], None] | None = None,
                 done: Callable[[], None] | None = None) -> None:
        self.stream, self.span, self._sent, self._done = stream, span, sent, done

    def steps(self, out: ModelSender) -> Steps:
        window = Window(out, self.span, self._sent)
        return window.steps(self.stream.steps(window))

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            if self._done is not None:
                self._done()
                self._done = None
