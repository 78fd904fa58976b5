"""Downloads of some rows of the global model: what a rank of a sharded job holds of it.

More: docs/architecture.md, "coordinator/model/slices.py".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.publish import Published, WeightsGuard, memory_steps
from fedtrain.errors import Refused, StateError
from fedtrain.transport.protocols import ModelSender, Steps
from fedtrain.wire import EncodedBody
from fedtrain.wire.digest import StreamingDigest
from fedtrain.wire.format import DTYPE_TO_ST, PREFIX_BYTES, ROWS_META, parse_header

#: The longest `rows` query accepted (a few thousand tensor names).
MAX_ROWS_CHARS = 1 << 16

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
Wanted = dict[str, tuple[int, int] | None]
"""Tensor name -> its rows [start, stop), or None: the whole tensor; in the model's order."""


def parse_rows(raw: str, model: Spec) -> Wanted:
    """The rows a `rows` query asks for, checked against the model; else a 400 `invalid_rows`."""
    if len(raw) > MAX_ROWS_CHARS:
        raise Refused(400, "invalid_rows", f"rows is {len(raw)} characters long, more than {MAX_ROWS_CHARS}")
    try:
        given = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, an integer of too many digits, nested too deep
        raise Refused(400, "invalid_rows", "rows must be a JSON object mapping tensor names to [start, stop] or null") \
            from None
    if not isinstance(given, dict) or not given:
        raise Refused(400, "invalid_rows", "rows must be a non-empty JSON object mapping tensor names to "
                      "[start, stop] or null")
    unknown = sorted(n for n in given if n not in model)
    if unknown:
        raise Refused(400, "invalid_rows", f"rows names tensors the model does not have: {', '.join(unknown[:5])}",
                      {"tensor": unknown[0]})
    wanted: Wanted = {}
    for name, (_, shape) in model.items():
        if name not in given:
            continue
        span = given[name]
        if span is None:
            wanted[name] = None
            continue
        if not shape:
            raise Refused(400, "invalid_rows", f"{name} is a scalar: ask for it whole (null), not by rows",
                          {"tensor": name})
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)
                or not 0 <= span[0] < span[1] <= shape[0]):
            raise Refused(400, "invalid_rows", f"rows of {name} must be [start, stop] with 0 <= start < stop <= "
                          f"{shape[0]}, or null", {"tensor": name})
        wanted[name] = (span[0], span[1])
    return wanted


def slice_metadata(model_meta: Mapping[str, str], wanted: Wanted) -> dict[str, str]:
    """A slice's metadata: the model's, and the ranges asked for (a tensor not named is whole)."""
    ranges = {n: [a, b] for n, span in wanted.items() if span is not None for a, b in [span]}
    return {**{k: v for k, v in model_meta.items() if k != ROWS_META},
            ROWS_META: json.dumps(ranges, separators=(",", ":"))}


def views(params: Mapping[str, torch.Tensor], wanted: Wanted) -> dict[str, torch.Tensor]:
    """The rows asked for, as views of `params` (no copy)."""
    return {n: params[n] if span is None else params[n][span[0]:span[1]] for n, span in wanted.items()}


HASH_BUFFER = 1 << 20
"""Bytes of a file read at once to hash a slice (one buffer per hash, reused across its reads)."""


class FileRows:
    """The rows of a committed model file one download sends: its header, built here, and where
    each tensor's rows lie in the file. The bytes are hashed through one small buffer and sent
    from the file (`ModelSender.sendfile_steps`): a download never holds a copy of its rows,
    however many ask for the same ones, so stalled downloads pin no more than their sockets."""

    def __init__(self, file: BinaryIO, wanted: Wanted, digest_algorithm: str) -> None:
        fd, self.name = file.fileno(), file.name
        prefix = os.pread(fd, PREFIX_BYTES, 0)
        if len(prefix) != PREFIX_BYTES:
            raise StateError(f"model file {file.name} is shorter than its header")
        length = int.from_bytes(prefix, "little")
        specs, meta = parse_header(os.pread(fd, length, PREFIX_BYTES))
        where, offset = {}, PREFIX_BYTES + length
        for spec in specs:  # in offset order, back to back (`parse_header` checked)
            where[spec.name] = (spec, offset)
            offset += spec.nbytes
        self.ranges: list[tuple[int, int]] = []  # (offset in the file, bytes), in the body's order
        entries: dict[str, Any] = {}
        metadata = slice_metadata(meta, wanted)
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        at = 0
        for name, span in wanted.items():
            if name not in where:
                raise StateError(f"model file {file.name} has no tensor {name!r}")
            spec, begin = where[name]
            start, stop = span if span is not None else (0, spec.shape[0] if spec.shape else 1)
            row = math.prod(spec.shape[1:]) * spec.dtype.itemsize
            shape = [stop - start, *spec.shape[1:]] if span is not None else list(spec.shape)
            nbytes = (stop - start) * row
            entries[name] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": shape, "data_offsets": [at, at + nbytes]}
            if nbytes:
                self.ranges.append((begin + start * row, nbytes))
            at += nbytes
        header.update(entries)
        # As `EncodedBody` writes it, so that a download moving from memory to the file goes on byte for byte.
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.header = len(raw).to_bytes(PREFIX_BYTES, "little") + raw
        self.content_length = len(self.header) + at
        self.digest_algorithm = digest_algorithm

    def digest(self, fd: int) -> str:
        """The body's digest, read from `fd` (this file, open) a buffer at a time."""
        state = StreamingDigest(self.digest_algorithm)
        state.update(self.header)
        buffer = memoryview(bytearray(min(HASH_BUFFER, max((n for _, n in self.ranges), default=1))))
        for begin, nbytes in self.ranges:
            offset, end = begin, begin + nbytes
            while offset < end:
                view = buffer[: min(len(buffer), end - offset)]
                _pread_into(fd, view, offset, self.name)
                state.update(view)
                offset += len(view)
        return state.digest()

    def steps(self, fd: int, out: ModelSender, offset: int = 0) -> Steps:
        """Send the body from byte `offset` on: the header from memory, the rows from the file."""
        head = memoryview(self.header)[offset:]
        while head:
            n = out.write_some(head)
            if n:
                head = head[n:]
            else:
                yield None
        offset = max(0, offset - len(self.header))
        for begin, nbytes in self.ranges:
            if offset >= nbytes:
                offset -= nbytes
                continue
            yield from out.sendfile_steps(fd, begin + offset, nbytes - offset)
            offset = 0


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise StateError(f"model file {name} ended before its tensors")
        view, offset = view[n:], offset + n


class SliceStream:
    """One download of rows of one global version: from views of the master weights (`memory`
    and `params`: the published version's) or from its committed file (`path`), never from a
    copy of its own. Made on the event loop; `prepare` (a worker thread) hashes the body, after
    which `size` and `digest` are the headers' values."""

    def __init__(self, version: int, wanted: Wanted, path: Path, files: CheckpointDir, *,
                 digest_algorithm: str | None = None, memory: Published | None = None,
                 guard: WeightsGuard | None = None, params: Mapping[str, torch.Tensor] | None = None) -> None:
        self.version, self.wanted, self.path, self.files = version, wanted, path, files
        self.memory, self.guard = memory, guard
        self.digest = ""
        self.body: EncodedBody | None = None  # from memory
        self.rows: FileRows | None = None  # from the file
        self._file: BinaryIO | None = None
        if memory is not None:
            assert params is not None and guard is not None
            self._algorithm = memory.body.digest_algorithm
            self.body = EncodedBody(views(params, wanted), slice_metadata(memory.body.metadata, wanted),
                                    digest_algorithm=self._algorithm)
        else:
            assert digest_algorithm is not None
            self._algorithm = digest_algorithm
            # Opened now, on the event loop, so that a prune cannot take the file before it is sent;
            # held open (a reader: never a spare) until the download ends (`close`).
            self._file = files.open_reader(path)

    @property
    def size(self) -> int:
        if self.body is not None:
            return self.body.content_length
        assert self.rows is not None, "prepare() first"
        return self.rows.content_length

    def prepare(self) -> None:
        """Worker thread: the body's digest. A version whose weights moved on since it was published
        is sent from its file, or is no longer available (404) when its commit failed. Closes the
        stream when it fails."""
        try:
            if self.memory is not None and self.guard is not None and self.body is not None:
                # Hashed without the guard lock, so that the slices of several ranks are hashed at
                # once and no download from memory waits: every change of the weights bumps the
                # epoch (under the lock) before it touches them, so an epoch unchanged after the
                # hash means that the views held the published weights throughout.
                if self._current():
                    digest = self.body.digest()
                    if self._current():
                        self.digest = digest
                        return
                if not (self.memory.settled.is_set() and self.memory.durable):
                    raise Refused(404, "version_not_kept", f"global model version {self.version} was not committed")
                self.memory, self.body = None, None
                self._file = self.files.open_reader(self.path)
            assert self._file is not None
            self.rows = FileRows(self._file, self.wanted, self._algorithm)
            self.digest = self.rows.digest(self._file.fileno())
        except BaseException:
            self.close()
            raise

    def _current(self) -> bool:
        """Whether the master weights are still those `memory` published."""
        assert self.guard is not None and self.memory is not None
        with self.guard.lock:
            return self.guard.epoch == self.memory.epoch

    def steps(self, out: ModelSender) -> Steps:
        """As `ModelStream.steps`: from the master weights, and what they no longer hold (they
        moved on mid-stream) from the committed file, as is a download from the file."""
        offset = 0
        if self.memory is not None and self.guard is not None and self.body is not None:
            offset = yield from memory_steps(self.body, self.memory, self.guard, out)
            if offset == self.size:
                return
            self._file = self.files.open_reader(self.path)
            self.rows = FileRows(self._file, self.wanted, self._algorithm)
        assert self._file is not None and self.rows is not None
        yield from self.rows.steps(self._file.fileno(), out, offset)

    def pump(self, out: ModelSender) -> None:
        """`steps`, taken on this thread alone: it waits for the client and the commit itself."""
        out.run(self.steps(out))

    def close(self) -> None:
        if self._file is not None:
            self.files.close_reader(self.path, self._file)
            self._file = None
