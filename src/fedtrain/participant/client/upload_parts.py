"""An update sent as parts (the coordinator's `intake/parts.py`): byte ranges of the exact body
a whole upload would send, each with its own digest, sent up to `streams` at a time.

`BodyParts` cuts an `EncodedBody` into parts without copying it (views over its chunks) and
hashes each part once. `send_parts` sends the parts the coordinator does not hold yet (up to
`transfer.streams` writing their bytes at once; `auto`: `probe_streams` measures), and
returns the answer of the part that completed the body (the whole upload's answer). A part
whose bytes are all written frees its stream for the next part while it waits for its
answer, on a connection of its own, so the link stays busy between parts (at most `streams`
more wait so). After a
broken or silent connection the caller asks which parts are held and calls it again: only
the rest travel. No torch at module level.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from fedtrain.transport.progress import Progress
from fedtrain.wire.digest import StreamingDigest

if TYPE_CHECKING:
    from fedtrain.wire.encode import EncodedBody

__all__ = ["BodyParts", "CountedProgress", "Send", "send_parts"]

#: The header that names the whole body's digest on each part (the coordinator's).
WHOLE_DIGEST_HEADER = "X-Fedtrain-Upload-Digest"


class BodyParts:
    """`body` as parts of `part_bytes` (the last one shorter): part i is its bytes
    [i * part_bytes, min(total, (i + 1) * part_bytes))."""

    def __init__(self, body: EncodedBody, part_bytes: int) -> None:
        self.body = body
        self.part_bytes = part_bytes
        self.total = body.content_length
        self.count = math.ceil(self.total / part_bytes)
        self._digests: dict[int, str] = {}
        self._lock = threading.Lock()

    def span(self, index: int) -> tuple[int, int]:
        start = index * self.part_bytes
        return start, min(self.total, start + self.part_bytes)

    def chunks(self, index: int) -> Iterator[memoryview]:
        """Part `index`'s bytes as views of the body's (no copy), in pieces of at most the body's chunk size."""
        start, stop = self.span(index)
        at, step = 0, self.body.chunk_size
        for _, view in self.body.segments():
            end = at + view.nbytes
            if end > start and at < stop:
                piece = view[max(0, start - at) : min(view.nbytes, stop - at)]
                for i in range(0, piece.nbytes, step):
                    yield piece[i : i + step]
            at = end
            if at >= stop:
                return

    def digest(self, index: int) -> str:
        """Part `index`'s digest (of the body's algorithm), hashed once."""
        with self._lock:
            known = self._digests.get(index)
        if known is not None:
            return known
        hasher = StreamingDigest(self.body.digest_algorithm)
        for chunk in self.chunks(index):
            hasher.update(chunk)
        with self._lock:
            self._digests[index] = hasher.digest()
        return self._digests[index]


class CountedProgress:
    """A `Progress` several sending threads add to (it takes one writer: a lock makes them one)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.progress is not None:
            with self._lock:
                self.progress.add(n)

    def counting(self, chunks: Iterator[memoryview], written: Callable[[], None] | None = None) -> Iterator[memoryview]:
        """`chunks`, counted as they are handed to the connection; `written()` once the last is."""
        for chunk in chunks:
            yield chunk
            self.add(chunk.nbytes)
        if written is not None:
            written()


#: `send(index, written)`: send part `index`, calling `written()` once its bytes are all
#: handed to the connection (then only its answer is awaited); its answer.
Send = Callable[[int, Callable[[], None]], dict[str, Any]]


def send_parts(parts: BodyParts, todo: list[int], streams: int | str, send: Send,
               log: logging.Logger | None = None) -> dict[str, Any] | None:
    """Send parts `todo` with `send`, up to `streams` writing at once ("auto": `probe_streams`
    picks the number as it goes); the answer that says the body is complete (None: none did,
    e.g. every part was in already but the update was not placed). The first failure is
    raised once the parts in flight have ended; parts not yet begun are not sent."""
    if not todo:
        return None
    if streams == "auto":
        return probe_streams(todo, send, log)
    return _side_by_side(todo, int(streams), send)


def _side_by_side(todo: list[int], width: int, send: Send) -> dict[str, Any] | None:
    """Parts `todo` in order, `width` of them writing bytes at once: a part whose bytes are
    written frees its stream (the next part starts on another connection) and waits for its
    answer, at most `width` such waits beside the writes."""
    width = max(1, width)
    writing = threading.Semaphore(width)
    failed = threading.Event()

    def one(index: int) -> dict[str, Any]:
        freed = False

        def written() -> None:
            nonlocal freed
            if not freed:
                freed = True
                writing.release()

        try:
            return send(index, written)
        except BaseException:
            failed.set()
            raise
        finally:
            written()

    final = None
    futures: list[Future[dict[str, Any]]] = []
    with ThreadPoolExecutor(min(2 * width, len(todo)), thread_name_prefix="fedtrain-part") as pool:
        for index in todo:
            writing.acquire()  # (every part frees its stream at the latest when it ends)
            if failed.is_set():
                writing.release()
                break
            futures.append(pool.submit(one, index))
        wait(futures)
    for f in futures:
        error = f.exception()
        if error is not None:
            raise error
        if f.result().get("parts_complete"):
            final = f.result()
    return final


def _nothing() -> None:
    pass


#: `streams: auto` doubles the connections while the rate grows by at least this factor.
AUTO_GAIN = 1.25
AUTO_MAX = 16


def probe_streams(todo: list[int], send: Send, log: logging.Logger | None = None) -> dict[str, Any] | None:
    """`streams: auto`: send the parts a round of P at a time, P = 1 first, doubling P while a
    round's rate (parts per second) beats the last one by AUTO_GAIN; once it does not, the
    rest go at the best P found. On a link one connection fills, P stays 1 (or falls back to
    it after one round of 2); where a single connection is held back (a long round trip, a
    relay), P grows until the link is full."""
    final, width, best, best_rate, at = None, 1, 1, 0.0, 0
    growing = True
    while at < len(todo):
        batch = todo[at : at + width]
        started = time.monotonic()
        # (one part alone on this thread: a pool's start would count against width 1's rate)
        answer = _side_by_side(batch, width, send) if width > 1 else send(batch[0], _nothing)
        if answer is not None and answer.get("parts_complete"):
            final = answer
        at += len(batch)
        rate = len(batch) / max(time.monotonic() - started, 1e-6)
        if growing:
            if rate >= best_rate * AUTO_GAIN and len(batch) == width:
                best, best_rate = width, rate
                width = min(width * 2, AUTO_MAX)
                growing = width > best
            else:
                growing = False
                width = best
                if log is not None:
                    log.info("streams auto: %d connection(s) for the rest of this upload", best)
    return final
