"""Safetensors bodies written and read as streams, never held whole in memory.

A body is the safetensors format: an 8-byte little-endian header length N, N bytes of
JSON header (padded with spaces so the data starts 8-byte aligned), then the tensors'
bytes back to back. `EncodedBody` yields the header and then zero-copy views of each
tensor's storage; `BodyReader` is a sans-IO parser that copies each incoming byte once,
straight into the destination tensor. Nothing here unpickles: the header is JSON and the
data are raw bytes, so a hostile body can at worst be refused with a `WireError`.

A body's digest ("sha256:<hex>", see `digest.py`) travels beside it; the reader checks it
in `finish()`. Tensors returned by `feed` before `finish()` succeeds are provisional: a
caller that folds them into shared state must be able to drop them if `finish` fails.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain import faults
from fedtrain.errors import WireError
from fedtrain.wire.digest import DIGEST_HEADER, StreamingDigest, digests_equal, parse_digest

__all__ = [
    "DIGEST_HEADER",
    "DTYPE_TO_ST",
    "MAX_HEADER_BYTES",
    "ST_TO_DTYPE",
    "BodyReader",
    "EncodedBody",
    "TensorSpec",
    "aread_tensors",
    "iter_file",
    "parse_header",
    "read_tensors",
    "spec_of",
    "write_file",
]

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
DEFAULT_CHUNK = 1 << 20
_PREFIX = 8
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}

_NAMES = [
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
]
ST_TO_DTYPE: dict[str, torch.dtype] = {st: getattr(torch, attr) for st, attr in _NAMES if hasattr(torch, attr)}
DTYPE_TO_ST: dict[torch.dtype, str] = {dtype: st for st, dtype in ST_TO_DTYPE.items()}


@dataclass(frozen=True)
class TensorSpec:
    """What a body says about one tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The specs of a mapping of tensors, in its order."""
    return {name: TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable uint8 memoryview over a contiguous CPU tensor's own storage."""
    # detach() shares storage (and lets .numpy() work on parameters); reshape(-1) of a
    # contiguous tensor is a view, and view(uint8) reinterprets it, bf16 and fp8 included.
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)  # type: ignore[arg-type]  # numpy stubs lack __buffer__


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise WireError(
                f"body metadata must map strings to strings; got {key!r}: {value!r} ({type(value).__name__})"
            )
        out[key] = value
    return out


class EncodedBody:
    """A safetensors body over live tensors, iterated as chunks without copying them.

    `header` is the first chunk (length prefix and padded JSON); the tensors follow in the
    mapping's order. Iterating again yields the same bytes, so the body can be hashed,
    sent, and re-sent on a retry; the tensors must not change meanwhile. Pass
    `content_length` as the Content-Length header and `digest()` as `DIGEST_HEADER`.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self._tensors = dict(tensors)
        self.specs = spec_of(self._tensors)
        self.metadata = _check_metadata(metadata)
        header: dict[str, Any] = {"__metadata__": self.metadata} if self.metadata else {}
        offset = 0
        for name, t in self._tensors.items():
            _check_encodable(name, t)
            end = offset + self.specs[name].nbytes
            header[name] = {
                "dtype": DTYPE_TO_ST[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.header: bytes = len(raw).to_bytes(_PREFIX, "little") + raw
        self.data_length = offset
        self.content_length: int = len(self.header) + offset
        self._digest: str | None = None

    def __iter__(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        step = self.chunk_size
        for t in self._tensors.values():
            if t.numel() == 0:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                # One tensor at a time, only when reached: peak extra memory is the
                # largest such tensor, not the body.
                t = t.detach().contiguous().to("cpu")
            view = _byte_view(t)
            for start in range(0, view.nbytes, step):
                yield view[start : start + step]

    async def aiter_chunks(self) -> AsyncIterator[memoryview]:
        """The same chunks as an async iterator, for `httpx.AsyncClient(content=...)`."""
        for chunk in self:
            yield chunk

    def digest(self) -> str:
        """ "sha256:<hex>" of the body's bytes, computed by one pass and then cached."""
        if self._digest is None:
            state = StreamingDigest()
            for chunk in self:
                state.update(chunk)
            self._digest = state.digest()
        return self._digest


def _check_encodable(name: str, t: torch.Tensor) -> None:
    if not isinstance(name, str) or name == "__metadata__":
        raise WireError(f"tensor name {name!r} cannot be used: names must be strings other than '__metadata__'")
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        raise WireError(
            f"tensor {name!r} must be a dense tensor with data, got {type(t).__name__} ({getattr(t, 'layout', '?')})"
        )
    if t.dtype not in DTYPE_TO_ST:
        raise WireError(
            f"tensor {name!r} has dtype {t.dtype}, which safetensors bodies do "
            f"not carry; convert it to one of {sorted(ST_TO_DTYPE)}"
        )


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write a safetensors file atomically (temp file, fsync, rename); return its digest."""
    body = EncodedBody(tensors, metadata)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    state = StreamingDigest()
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in body:
                state.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        faults.hit("file.before_rename")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return state.digest()


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is; Windows cannot open dirs.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_file(path: str | os.PathLike[str], chunk_size: int = DEFAULT_CHUNK) -> Iterator[bytes]:
    """Read a file as chunks of at most chunk_size bytes."""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            yield chunk


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
        self._hash = StreamingDigest() if expected_digest is not None else None
        if expected_digest is not None:
            parse_digest(expected_digest)
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
                pos = self._take_head(mv, pos, _PREFIX)
                if len(self._head) == _PREFIX:
                    self._start_header()
            elif self._state == _HEADER_STATE:
                pos = self._take_head(mv, pos, _PREFIX + self._header_length)
                if len(self._head) == _PREFIX + self._header_length:
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
        n = int.from_bytes(self._head[:_PREFIX], "little")
        limit = MAX_HEADER_BYTES
        if self.max_bytes is not None:
            limit = min(limit, max(self.max_bytes - _PREFIX, 0))
        if n == 0:
            raise WireError("tensor body header length is 0; this is not a safetensors body")
        if n > limit:
            raise WireError(
                f"tensor body header length {n} exceeds the limit of {limit} bytes; "
                "this is not a safetensors body or it is too large"
            )
        if self.expected_length is not None and _PREFIX + n > self.expected_length:
            raise WireError(
                f"tensor body header length {n} does not fit in the declared "
                f"body length of {self.expected_length} bytes"
            )
        self._header_length = n
        self._state = _HEADER_STATE

    def _parse_header(self, out: list[tuple[str, torch.Tensor]]) -> None:
        order, metadata = parse_header(bytes(self._head[_PREFIX:]))
        self._head = bytearray()
        total = _PREFIX + self._header_length + sum(s.nbytes for s in order)
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
        if self._view is None:
            # Allocated on its first byte, so a header that promises more than is sent
            # costs at most one tensor's allocation.
            self._current = self._new_tensor(self._order[self._index])
            self._view, self._filled = _byte_view(self._current), 0
        view = self._view
        take = min(view.nbytes - self._filled, mv.nbytes - pos)
        view[self._filled : self._filled + take] = mv[pos : pos + take]
        self._filled += take
        if self._filled == view.nbytes:
            assert self._current is not None
            out.append((self._order[self._index].name, self._current))
            self._current = self._view = None
            self._index += 1
            self._advance(out)
        return pos + take

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
            got = self._hash.digest()
            if not digests_equal(got, self._expected_digest):
                self._failed = (
                    f"body digest mismatch: expected {self._expected_digest}, got "
                    f"{got}; the body was corrupted in transit, send it again"
                )
                raise WireError(self._failed)
        self._finished = True

    def digest(self) -> str | None:
        """ "sha256:<hex>" of the bytes fed so far, when an expected digest was given."""
        return self._hash.digest() if self._hash is not None else None

    def _truncation_message(self) -> str:
        got = self.bytes_received
        if self.total_length is not None:
            need = f"{self.total_length} bytes"
        elif self._state == _HEADER_STATE:
            need = f"at least {_PREFIX + self._header_length} bytes (the header alone)"
        else:
            need = f"at least {_PREFIX} bytes (the length prefix)"
        return f"tensor body truncated: expected {need}, received {got}; the connection was probably cut, send it again"


def parse_header(raw: bytes) -> tuple[list[TensorSpec], dict[str, str]]:
    """Validate a safetensors JSON header; return the specs in offset order and metadata."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise WireError(f"tensor body header is not valid UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise WireError(f"tensor body header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError(f"tensor body header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("tensor body '__metadata__' must map strings to strings")
    entries = [(*_parse_entry(name, entry), name) for name, entry in header.items()]
    entries.sort(key=lambda e: (e[1], e[2]))
    expected = 0
    for _spec, begin, end, name in entries:
        if begin != expected:
            what = "gap" if begin > expected else "overlap"
            raise WireError(
                f"tensor body header has a {what}: tensor {name!r} starts at byte "
                f"{begin} of the data but the previous tensor ends at {expected}"
            )
        expected = end
    return [e[0] for e in entries], metadata


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise WireError(f"tensor body header names {key!r} twice")
        out[key] = value
    return out


def _parse_entry(name: str, entry: Any) -> tuple[TensorSpec, int, int]:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise WireError(
            f"tensor body header entry {name!r} must be an object with exactly "
            f"'dtype', 'shape' and 'data_offsets', got {entry!r:.200}"
        )
    dtype = ST_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise WireError(f"tensor {name!r} has unknown dtype {entry['dtype']!r}; supported: {', '.join(ST_TO_DTYPE)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise WireError(f"tensor {name!r} has invalid shape {shape!r:.200}: expected a list of integers in [0, 2**63)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise WireError(
            f"tensor {name!r} has invalid data_offsets {offsets!r:.200}: "
            "expected [begin, end] with 0 <= begin <= end < 2**63"
        )
    spec = TensorSpec(name, dtype, tuple(shape))
    begin, end = offsets
    if end - begin != spec.nbytes:
        raise WireError(
            f"tensor {name!r} of {entry['dtype']} {spec.shape} needs {spec.nbytes} "
            f"bytes but its data_offsets {offsets} span {end - begin}"
        )
    return spec, begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


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
