"""Downloads of some rows of the global model: what a rank of a sharded job holds of it.

More: docs/architecture.md, "coordinator/model/slices.py".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.publish import SEND_PIECE, Published, WeightsGuard, Work, memory_steps
from fedtrain.errors import Refused, StateError
from fedtrain.transport.protocols import ModelSender, Steps
from fedtrain.wire import EncodedBody
from fedtrain.wire.format import PREFIX_BYTES, ROWS_META, byte_view, parse_header

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


def read_slice(file: BinaryIO, wanted: Wanted, digest_algorithm: str) -> EncodedBody:
    """The slice of a model file: only the rows asked for are read, each into a tensor of its own."""
    fd = file.fileno()
    prefix = os.pread(fd, PREFIX_BYTES, 0)
    if len(prefix) != PREFIX_BYTES:
        raise StateError(f"model file {file.name} is shorter than its header")
    length = int.from_bytes(prefix, "little")
    specs, meta = parse_header(os.pread(fd, length, PREFIX_BYTES))
    where, offset = {}, PREFIX_BYTES + length
    for spec in specs:  # in offset order, back to back (`parse_header` checked)
        where[spec.name] = (spec, offset)
        offset += spec.nbytes
    out: dict[str, torch.Tensor] = {}
    for name, span in wanted.items():
        if name not in where:
            raise StateError(f"model file {file.name} has no tensor {name!r}")
        spec, begin = where[name]
        start, stop = span if span is not None else (0, spec.shape[0] if spec.shape else 1)
        row = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        t = torch.empty((stop - start, *spec.shape[1:]) if spec.shape else (), dtype=spec.dtype)
        if t.numel():
            _pread_into(fd, byte_view(t), begin + start * row, file.name)
        out[name] = t
    return EncodedBody(out, slice_metadata(meta, wanted), digest_algorithm=digest_algorithm)


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise StateError(f"model file {name} ended before its tensors")
        view, offset = view[n:], offset + n


class SliceStream:
    """One download of rows of one global version: from views of the master weights (`memory`
    and `params`: the published version's) or from its committed file (`path`). Made on the
    event loop; `prepare` (a worker thread) reads the rows from the file if need be and hashes
    the body, after which `size` and `digest` are the headers' values."""

    def __init__(self, version: int, wanted: Wanted, path: Path, files: CheckpointDir, *,
                 digest_algorithm: str | None = None, memory: Published | None = None,
                 guard: WeightsGuard | None = None, params: Mapping[str, torch.Tensor] | None = None) -> None:
        self.version, self.wanted, self.path, self.files = version, wanted, path, files
        self.memory, self.guard = memory, guard
        self.digest = ""
        self.body: EncodedBody | None = None
        self._file: BinaryIO | None = None
        if memory is not None:
            assert params is not None and guard is not None
            self._algorithm = memory.body.digest_algorithm
            self.body = EncodedBody(views(params, wanted), slice_metadata(memory.body.metadata, wanted),
                                    digest_algorithm=self._algorithm)
        else:
            assert digest_algorithm is not None
            self._algorithm = digest_algorithm
            # Opened now, on the event loop, so that a prune cannot take the file before it is read.
            self._file = files.open_reader(path)

    @property
    def size(self) -> int:
        assert self.body is not None, "prepare() first"
        return self.body.content_length

    def prepare(self) -> None:
        """Worker thread: the body (read from the file when not served from memory) and its
        digest. A version whose weights moved on since it was published is read from its file,
        or is no longer available (404) when its commit failed."""
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
                self.memory = None
                self._file = self.files.open_reader(self.path)
            assert self._file is not None
            self.body = read_slice(self._file, self.wanted, self._algorithm)
            self.digest = self.body.digest()
        finally:
            self.close()

    def _current(self) -> bool:
        """Whether the master weights are still those `memory` published."""
        assert self.guard is not None and self.memory is not None
        with self.guard.lock:
            return self.guard.epoch == self.memory.epoch

    def _committed(self) -> EncodedBody:
        """The slice read from the committed file (the weights moved on mid-stream)."""
        file = self.files.open_reader(self.path)
        try:
            return read_slice(file, self.wanted, self._algorithm)
        finally:
            self.files.close_reader(self.path, file)

    def steps(self, out: ModelSender) -> Steps:
        """As `ModelStream.steps`; what is not sent from the master weights goes from memory of
        its own (the rows read from the file)."""
        assert self.body is not None
        body, offset = self.body, 0
        if self.memory is not None and self.guard is not None:
            offset = yield from memory_steps(body, self.memory, self.guard, out)
            if offset == self.size:
                return
            load = Work(self._committed)  # read on the pump's thread, or on a worker thread
            yield load
            body = load.result
        for view in _views_from(body, offset, SEND_PIECE):
            while view:
                n = out.write_some(view)
                if n:
                    view = view[n:]
                else:
                    yield None

    def pump(self, out: ModelSender) -> None:
        """`steps`, taken on this thread alone: it waits for the client and the commit itself."""
        out.run(self.steps(out))

    def close(self) -> None:
        if self._file is not None:
            self.files.close_reader(self.path, self._file)
            self._file = None


def _views_from(body: EncodedBody, offset: int, size: int) -> Iterator[memoryview]:
    """The bytes of `body` from `offset` on, in pieces of at most `size`."""
    for _, view in body.segments():
        if offset >= view.nbytes:
            offset -= view.nbytes
            continue
        view, offset = view[offset:], 0
        for start in range(0, view.nbytes, size):
            yield view[start:start + size]
