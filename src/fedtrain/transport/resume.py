"""A model download across its attempts: after a broken connection the next attempt asks for
the rest of the same body (`Range: bytes=<received>-`, `If-Range: <its ETag>`) and goes on
reading it into place, the running digest state kept, so the digest of the whole body is still
checked once at the end.

The coordinator answers 206 with the rest (the body is still the one begun), or 200 with a
whole body when the validator no longer matches (the version asked for moved on: a download of
"the newest" after a new round committed): the download starts over on that one. A body whose
digest does not match at the end is dropped whole and fetched again from its first byte.

More: docs/architecture.md, "transport/resume.py".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from fedtrain.errors import WireError
from fedtrain.transport.direct_http import ModelBody
from fedtrain.transport.progress import Progress

if TYPE_CHECKING:
    import torch

    from fedtrain.wire.format import TensorSpec

__all__ = ["PartialDownload"]

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class PartialDownload:
    """What one download holds between its attempts: the body read so far (`ModelBody`) and the
    validator that names it. One thread uses it (the caller's); `close` ends its hash thread."""

    def __init__(self, what: str, allocate: Callable[[TensorSpec], torch.Tensor] | None,
                 on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None,
                 log: logging.Logger | None = None) -> None:
        self.what, self._allocate, self._on_header, self._log = what, allocate, on_header, log
        self.body: ModelBody | None = None
        self.etag: str | None = None
        self.progress: Progress | None = None
        self.resumed = 0  # attempts that went on from where the one before stopped
        self.restarts = 0  # whole bodies begun after the first (a stale validator, a bad digest)

    def headers(self) -> dict[str, str]:
        """The next attempt's conditional range: the rest of the body begun, if it can resume."""
        body = self.body
        if body is None or self.etag is None or not body.resumable or body.received == 0:
            return {}
        return {"Range": f"bytes={body.received}-", "If-Range": self.etag}

    def start(self, status: int, headers: httpx.Headers) -> ModelBody:
        """The response's headers are in (a 200 or a 206): the body its bytes go into."""
        body = self.body
        if status == 206:
            if body is None or not body.resumable:
                raise WireError("the coordinator answered a range this download did not ask for")
            first, total = self._content_range(headers)
            if first != body.received or total != body.length or headers.get("etag") != self.etag:
                self.drop()  # not the rest of this body: the next attempt fetches it whole
                raise WireError(f"the coordinator sent bytes from {first} of {total} ({headers.get('etag')}), "
                                f"not the rest of the body begun ({body.received} of {body.length}, {self.etag})")
            self.resumed += 1
            if self._log is not None:
                self._log.info("%s resumes at byte %d of %d", self.what, body.received, total)
            return body
        if body is not None:
            self.restarts += 1
            if self._log is not None and body.received:
                self._log.info("%s starts over: the body changed (%s, was %s)", self.what, headers.get("etag"),
                               self.etag)
        self.drop()
        length = int(headers["content-length"]) if "content-length" in headers else None
        self.progress = Progress(self.what, length, log=self._log)
        self.body = ModelBody(headers, self._allocate, self._on_header, self.progress.add)
        self.etag = headers.get("etag")
        return self.body

    def _content_range(self, headers: httpx.Headers) -> tuple[int, int]:
        match = _CONTENT_RANGE.match(headers.get("content-range", ""))
        if match is None:
            self.drop()
            raise WireError(f"a 206 answer with Content-Range {headers.get('content-range')!r}")
        return int(match.group(1)), int(match.group(3))

    def finish(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The whole body's tensors, its digest checked; a mismatch drops it (fetched whole next)."""
        assert self.body is not None
        try:
            return self.body.finish()
        except WireError:
            if not self.body.resumable:
                self.drop()
            raise

    def failed(self) -> None:
        """An attempt failed: keep what came if the rest can follow, else drop it."""
        if self.body is not None and not self.body.resumable:
            self.drop()

    def drop(self) -> None:
        if self.body is not None:
            self.body.__exit__()
        self.body, self.etag = None, None

    def close(self) -> None:
        self.drop()
