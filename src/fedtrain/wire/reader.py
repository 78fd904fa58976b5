"""Decoding: a safetensors body parsed as it arrives, each byte copied once into its tensor.

`BodyReader` is a sans-IO parser: it validates the header in full before it accepts a data
byte, refuses a body longer than declared or allowed, and copies each incoming byte straight
into the destination tensor. `read_tensors` and `aread_tensors` drive it over sync and async
streams of chunks.

A body's digest ("xxh3-128:<hex>" or "sha256:<hex>", see `digest.py`) travels beside it; the reader checks it
in `finish()`. Tensors returned by `feed` before `finish()` succeeds are provisional: a
caller that folds them into shared state must be able to drop them if `finish` fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

import torch

from fedtrain.errors import WireError
from fedtrain.wire.digest import StreamingDigest, verify_digest
from fedtrain.wire.format import MAX_HEADER_BYTES, PREFIX_BYTES, TensorSpec, byte_view, parse_header

__all__ = ["Allocate", "BodyReader", "OnHeader", "aread_tensors", "read_tensors"]

Allocate = Callable[[TensorSpec], torch.Tensor]
OnHeader = Callable[[dict[str, TensorSpec], dict[str, str]], None]

_PREFIX_STATE, _HEADER_STATE, _DATA_STATE, _DONE_STATE = range(4)


class BodyReader:
    """Incremental, sans-IO parser of one safetensors body; feed it chunks as they arrive.

    `feed` returns the tensors completed by each chunk, in body order; `finish` then checks
    the body was complete and matches `expected_digest`. The header is validated in full
    (and `on_header` called) before a single data byte is accepted. Chunks are not kept:
    a caller may reuse its receive buffer after `feed` returns. After any error the reader
    refuses further input. With `store_data=False` it only checks (header, length, digest)
    and keeps no tensor bytes at all: `feed` then returns nothing.
    """

    def __init__(
        self,
        *,
        expected_digest: str | None = None,
        max_bytes: int | None = None,
        expected_length: int | None = None,
        allocate: Allocate | None = None,
        on_header: OnHeader | None = None,
        store_data: bool = True,
    ) -> None:
        self._store = store_data
        self._expected_digest = expected_digest
        self._hash = StreamingDigest.like(expected_digest) if expected_digest is not None else None
        self.max_bytes = max_bytes
        self.expected_length = expected_length
        self._allocate = allocate
        self._on_header = on_header
        self._state = _PREFIX_STATE
        self._head = bytearray()
        self._header_length = 0
        self.specs: dict[str, TensorSpec] | None = None
        self.metadata: dict[str, str] = {}
        self.total_length: int | None = None
        self.bytes_received = 0
        self._order: list[TensorSpec] = []
        self._index = 0
        self._current: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._filled = 0
        self._failed: str | None = None
        self._finished = False

    @property
    def layout(self) -> list[tuple[TensorSpec, int]]:
        """Each tensor's spec with the offset of its first byte in the body, in body order
        (empty until the header has been read)."""
        out, offset = [], PREFIX_BYTES + self._header_length
        for spec in self._order:
            out.append((spec, offset))
            offset += spec.nbytes
        return out

    @property
    def header_ready(self) -> bool:
        return self.specs is not None

    @property
    def done(self) -> bool:
        return self._state == _DONE_STATE

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
        """Accept the next bytes of the body; return the tensors they completed."""
        if self._failed is not None:
            raise WireError(f"the body was already refused: {self._failed}")
        try:
            return self._feed(chunk)
        except Exception as exc:
            self._failed = str(exc)
            raise

    @property
    def head_needed(self) -> int:
        """Bytes still missing from the length prefix or the header (0 once the data begins):
        reading exactly this many never reads past the header."""
        if self._state == _PREFIX_STATE:
            return PREFIX_BYTES - len(self._head)
        if self._state == _HEADER_STATE:
            return PREFIX_BYTES + self._header_length - len(self._head)
        return 0

    def writable(self) -> memoryview | None:
        """Where the next data bytes go: the unfilled rest of the current tensor's storage,
        for a caller that reads from its socket straight into it (`readinto`) and then calls
        `wrote`. None while the header is still expected (`feed` it), when the body is
        complete, or when the reader keeps no data."""
        if self._failed is not None or self._state != _DATA_STATE or not self._store:
            return None
        return self._current_view()[self._filled :]

    def wrote(self, n: int) -> list[tuple[str, torch.Tensor]]:
        """Account for `n` bytes the caller wrote at the start of `writable()`; return the
        tensors they completed. Length checks and the digest see them as `feed` would."""
        if self._failed is not None:
            raise WireError(f"the body was already refused: {self._failed}")
        try:
            view = self._view
            if view is None or not 0 <= n <= view.nbytes - self._filled:
                raise WireError(f"wrote({n}) does not fit the writable region")  # a caller's bug
            if n == 0:
                return []
            self._check_room(n)
            if self._hash is not None:
                self._hash.update(view[self._filled : self._filled + n])
            self.bytes_received += n
            out: list[tuple[str, torch.Tensor]] = []
            self._filled_by(n, out)
            return out
        except Exception as exc:
            self._failed = str(exc)
            raise

    def _feed(self, chunk: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
        mv = memoryview(chunk)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = mv.nbytes
        if n == 0:
            return []
        self._check_room(n)
        if self._hash is not None:
            self._hash.update(mv)
        self.bytes_received += n
        out: list[tuple[str, torch.Tensor]] = []
        pos = 0
        while pos < n:
            if self._state == _PREFIX_STATE:
                pos = self._take_head(mv, pos, PREFIX_BYTES)
                if len(self._head) == PREFIX_BYTES:
                    self._start_header()
            elif self._state == _HEADER_STATE:
                pos = self._take_head(mv, pos, PREFIX_BYTES + self._header_length)
                if len(self._head) == PREFIX_BYTES + self._header_length:
                    self._parse_header(out)
            else:
                pos = self._take_data(mv, pos, out)
        return out

    def _check_room(self, n: int) -> None:
        after = self.bytes_received + n
        if self.total_length is not None and after > self.total_length:
            raise WireError(
                f"tensor body has trailing bytes: its header promises {self.total_length} bytes but {after} arrived"
            )
        if self.expected_length is not None and after > self.expected_length:
            raise WireError(
                f"tensor body is longer than its declared length of {self.expected_length} bytes ({after} arrived)"
            )
        if self.max_bytes is not None and after > self.max_bytes:
            raise WireError(f"tensor body exceeds the limit of {self.max_bytes} bytes")

    def _take_head(self, mv: memoryview, pos: int, upto: int) -> int:
        take = min(upto - len(self._head), mv.nbytes - pos)
        self._head += mv[pos : pos + take]
        return pos + take

    def _start_header(self) -> None:
        n = int.from_bytes(self._head[:PREFIX_BYTES], "little")
        limit = MAX_HEADER_BYTES
        if self.max_bytes is not None:
            limit = min(limit, max(self.max_bytes - PREFIX_BYTES, 0))
        if n == 0:
            raise WireError("tensor body header length is 0; this is not a safetensors body")
        if n > limit:
            raise WireError(
                f"tensor body header length {n} exceeds the limit of {limit} bytes; "
                "this is not a safetensors body or it is too large"
            )
        if self.expected_length is not None and PREFIX_BYTES + n > self.expected_length:
            raise WireError(
                f"tensor body header length {n} does not fit in the declared "
                f"body length of {self.expected_length} bytes"
            )
        self._header_length = n
        self._state = _HEADER_STATE

    def _parse_header(self, out: list[tuple[str, torch.Tensor]]) -> None:
        order, metadata = parse_header(bytes(self._head[PREFIX_BYTES:]))
        self._head = bytearray()
        total = PREFIX_BYTES + self._header_length + sum(s.nbytes for s in order)
        if self.max_bytes is not None and total > self.max_bytes:
            raise WireError(f"tensor body of {total} bytes exceeds the limit of {self.max_bytes} bytes")
        if self.expected_length is not None and total != self.expected_length:
            raise WireError(
                f"tensor body header describes {total} bytes but the declared body length is {self.expected_length}"
            )
        if self.bytes_received > total:
            raise WireError(
                f"tensor body has trailing bytes: its header promises {total} bytes but {self.bytes_received} arrived"
            )
        specs = {s.name: s for s in order}
        if self._on_header is not None:
            self._on_header(dict(specs), dict(metadata))
        self._order, self.specs, self.metadata, self.total_length = order, specs, metadata, total
        self._state = _DATA_STATE
        self._advance(out)

    def _advance(self, out: list[tuple[str, torch.Tensor]]) -> None:
        """Step to the next tensor with bytes, emitting empty ones on the way."""
        while self._index < len(self._order):
            spec = self._order[self._index]
            if spec.nbytes > 0:
                return
            if self._store:
                out.append((spec.name, self._new_tensor(spec)))
            self._index += 1
        self._state = _DONE_STATE

    def _take_data(self, mv: memoryview, pos: int, out: list[tuple[str, torch.Tensor]]) -> int:
        if self._state == _DONE_STATE:  # _check_room already refuses this; kept for safety
            raise WireError("tensor body has trailing bytes after its last tensor")
        if not self._store:  # checking only (length, digest): count the bytes, keep none
            take = min(self._order[self._index].nbytes - self._filled, mv.nbytes - pos)
            self._filled += take
            if self._filled == self._order[self._index].nbytes:
                self._filled = 0
                self._index += 1
                self._advance(out)
            return pos + take
        view = self._current_view()
        take = min(view.nbytes - self._filled, mv.nbytes - pos)
        view[self._filled : self._filled + take] = mv[pos : pos + take]
        self._filled_by(take, out)
        return pos + take

    def _current_view(self) -> memoryview:
        """The bytes of the tensor being filled. Allocated on its first byte, so a header
        that promises more than is sent costs at most one tensor's allocation."""
        if self._view is None:
            self._current = self._new_tensor(self._order[self._index])
            self._view, self._filled = byte_view(self._current), 0
        return self._view

    def _filled_by(self, n: int, out: list[tuple[str, torch.Tensor]]) -> None:
        """`n` more bytes of the current tensor are in place; emit it once it is whole."""
        assert self._view is not None and self._current is not None
        self._filled += n
        if self._filled == self._view.nbytes:
            out.append((self._order[self._index].name, self._current))
            self._current = self._view = None
            self._index += 1
            self._advance(out)

    def _new_tensor(self, spec: TensorSpec) -> torch.Tensor:
        if self._allocate is None:
            try:
                return torch.empty(spec.shape, dtype=spec.dtype)
            except (RuntimeError, TypeError, ValueError) as exc:
                reason = str(exc).splitlines()[0][:200]
                raise WireError(
                    f"cannot allocate tensor {spec.name!r} of {spec.dtype} {spec.shape} "
                    f"({reason}); set max_bytes to refuse such bodies up front"
                ) from None
        t = self._allocate(spec)
        if (
            not isinstance(t, torch.Tensor)
            or t.device.type != "cpu"
            or t.layout != torch.strided
            or t.dtype != spec.dtype
            or tuple(t.shape) != spec.shape
            or not t.is_contiguous()
        ):
            got = (
                f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise WireError(
                f"allocate() for tensor {spec.name!r} must return a contiguous CPU "
                f"tensor of {spec.dtype} {spec.shape}, got {got}"
            )
        return t

    def finish(self) -> None:
        """Check the body arrived whole and matches its digest; raise WireError if not."""
        if self._failed is not None:
            raise WireError(f"the body was already refused: {self._failed}")
        if self._state != _DONE_STATE:
            self._failed = self._truncation_message()
            raise WireError(self._failed)
        if self._hash is not None and self._expected_digest is not None and not self._finished:
            try:
                verify_digest(self._hash.digest(), self._expected_digest)
            except WireError as e:
                self._failed = e.message
                raise
        self._finished = True

    def truncated(self) -> str | None:
        """Why the body is not complete yet (None: it is, or it was refused). Unlike `finish`,
        this leaves the reader as it is: a body cut short takes its missing bytes later (a
        resumed download, `transport/resume.py`), its running digest state kept."""
        if self._failed is not None or self._state == _DONE_STATE:
            return None
        return self._truncation_message()

    def digest(self) -> str | None:
        """The digest of the bytes fed so far (the expected digest's algorithm), when one was given."""
        return self._hash.digest() if self._hash is not None else None

    def _truncation_message(self) -> str:
        got = self.bytes_received
        if self.total_length is not None:
            need = f"{self.total_length} bytes"
        elif self._state == _HEADER_STATE:
            need = f"at least {PREFIX_BYTES + self._header_length} bytes (the header alone)"
        else:
            need = f"at least {PREFIX_BYTES} bytes (the length prefix)"
        return f"tensor body truncated: expected {need}, received {got}; the connection was probably cut, send it again"


def read_tensors(
    chunks: Iterable[bytes | bytearray | memoryview],
    *,
    expected_digest: str | None = None,
    max_bytes: int | None = None,
    expected_length: int | None = None,
    allocate: Allocate | None = None,
    on_header: OnHeader | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a stream of chunks; checks completeness and digest at the
    end, so only a fully consumed iterator has verified the body."""
    reader = BodyReader(
        expected_digest=expected_digest,
        max_bytes=max_bytes,
        expected_length=expected_length,
        allocate=allocate,
        on_header=on_header,
    )
    for chunk in chunks:
        yield from reader.feed(chunk)
    reader.finish()


async def aread_tensors(
    chunks: AsyncIterable[bytes | bytearray | memoryview],
    *,
    expected_digest: str | None = None,
    max_bytes: int | None = None,
    expected_length: int | None = None,
    allocate: Allocate | None = None,
    on_header: OnHeader | None = None,
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """The async twin of `read_tensors`, e.g. over starlette's `request.stream()`."""
    reader = BodyReader(
        expected_digest=expected_digest,
        max_bytes=max_bytes,
        expected_length=expected_length,
        allocate=allocate,
        on_header=on_header,
    )
    async for chunk in chunks:
        for item in reader.feed(chunk):
            yield item
    reader.finish()
