"""Updates that arrive in pieces: several bodies covering disjoint parts of the sync set.

More: docs/architecture.md, "coordinator/intake/pieces.py".
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fedtrain.errors import MergeError, Refused, WireError
from fedtrain.merge import check_compatible
from fedtrain.wire import DTYPE_TO_ST, TensorSpec
from fedtrain.wire.compress import codec_of, decompress, expected_specs, fit_specs, is_part, parts_of
from fedtrain.wire.format import ROWS_META, byte_view

#: The most pieces one update may come in: each waits in a spool file of its own until the
#: update is complete (a rank each for FSDP, a fragment each for Streaming DiLoCo).
MAX_PIECES = 256
#: The labels of an update's pieces the status lists (it counts them all).
SHOWN_LABELS = 16
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Pieces of one participant's update streaming in at once: one per rank of its group (join
#: `info.world_size`), at least MIN (a process may send a few at once) and at most MAX. Each
#: holds a connection, up to two receive batches of memory (`receive.BATCH`) and a spool file.
MIN_PIECES_IN_FLIGHT = 4
MAX_PIECES_IN_FLIGHT = 64
#: What a 429 pieces_in_flight asks the client to wait.
PIECE_RETRY_AFTER_S = 1.0
#: The longest `fedtrain.rows` metadata value of a piece (a few thousand tensor names).
MAX_ROWS_META_CHARS = 1 << 16

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
Rows = dict[str, tuple[int, int]]


def check_label(label: str) -> None:
    if not LABEL_RE.match(label):
        raise Refused(400, "invalid_piece", f"piece label {label!r} must be 1-64 letters, digits, '_', '.' or '-'")


def piece_rows(specs: Mapping[str, TensorSpec], metadata: Mapping[str, str], model: Spec) -> Rows:
    """The rows of each model tensor a piece's header holds, checked against the model:
    names it knows, row ranges inside each tensor, and the shapes and dtypes those rows have
    under the body's compression. Raises WireError or MergeError (a 4xx) otherwise."""
    raw = metadata.get(ROWS_META)
    if raw is not None and len(raw) > MAX_ROWS_META_CHARS:
        raise WireError(f"metadata {ROWS_META} is {len(raw):,} characters long, more than {MAX_ROWS_META_CHARS:,}")
    try:
        given = json.loads(raw) if raw is not None else {}
    except (ValueError, RecursionError):  # not JSON, an integer of too many digits, nested too deep
        raise WireError(f"metadata {ROWS_META} must be a JSON object mapping tensor names to [start, stop] "
                        "rows") from None
    if not isinstance(given, dict):
        raise WireError(f"metadata {ROWS_META} must map tensor names to [start, stop] rows")
    names = [n for n in specs if not is_part(n)]
    if not names:
        raise WireError("a piece holds no tensor")
    rows: Rows = {}
    for name in names:
        if name not in model:
            raise MergeError(f"piece holds tensor {name!r}, which the model does not have")
        _, shape = model[name]
        span = given.get(name)
        if span is None:
            rows[name] = (0, shape[0] if shape else 1)
            continue
        if not shape:
            raise WireError(f"{name} is a scalar: a piece holds it whole, not by rows")
        if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                  for v in span)
                or not 0 <= span[0] < span[1] <= shape[0]):
            raise WireError(f"rows of {name} in {ROWS_META} must be [start, stop] with 0 <= start < stop <= "
                            f"{shape[0]}, got {_shown(span)}")
        rows[name] = (span[0], span[1])
    unknown = sorted(set(given) - set(rows))
    if unknown:
        raise WireError(f"{ROWS_META} names tensors the piece does not hold: {', '.join(unknown[:5])}")
    codec = codec_of(metadata)
    want = expected_specs(sliced(model, rows), codec)
    check_compatible(want, fit_specs(want, {n: (s.dtype, s.shape) for n, s in specs.items()}, codec), what="piece")
    return rows


def _shown(value: object) -> str:
    """`value` as an error message shows it: at most 60 characters (a row may have 4,000 digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = "a number of too many digits"
    return text if len(text) <= 60 else text[:57] + "..."


def in_flight_cap(ranks: int | None) -> int:
    """How many pieces of one participant's update may stream in at once: one per rank of its
    group (`ranks`, None when it did not say), within [MIN_PIECES_IN_FLIGHT, MAX_PIECES_IN_FLIGHT]."""
    return max(MIN_PIECES_IN_FLIGHT, min(ranks or 1, MAX_PIECES_IN_FLIGHT))


def header_allowance(model: Spec) -> int:
    """The most header bytes one honest piece needs: every tensor of the sync set named twice
    (a compressed tensor and its scales), each entry with its rows, and the metadata."""
    return 4096 + sum(2 * (2 * len(name) + 160) for name in model)


def room_for_piece(update: str, label: str, length: int, held: int, pieces_in: int, in_flight: Mapping[str, int],
                   ranks: int | None, limit: int, header: int) -> Refused | None:
    """Whether piece `label` (`length` bytes) of `update` (its words) may start streaming in, it
    holding `pieces_in` pieces of `held` bytes so far and `in_flight` (label: bytes) streaming:
    None, else why not. At most `in_flight_cap(ranks)` at once (429: one finishes soon), and
    the pieces together at most `limit` (max_upload_mb: what the update sent whole may hold)
    plus `header` per piece: 429 while some stream in, else 413."""
    cap = in_flight_cap(ranks)
    wait = {"retry_after_s": PIECE_RETRY_AFTER_S, "limit": cap}
    if len(in_flight) >= cap:
        return Refused(429, "pieces_in_flight", f"{len(in_flight)} pieces of {update} are streaming in, the most "
                       f"at once ({cap}: one per rank of the participant's group, world_size in its join info, "
                       f"{MIN_PIECES_IN_FLIGHT} to {MAX_PIECES_IN_FLIGHT}); send piece {label!r} again once one is "
                       f"in, in {PIECE_RETRY_AFTER_S:g}s", wait)
    total = held + sum(in_flight.values()) + length
    budget = limit + header * (pieces_in + len(in_flight) + 1)
    if total <= budget:
        return None
    what = (f"piece {label!r} ({length:,} bytes) would make the pieces of {update} hold {total:,} bytes, more "
            f"than max_upload_mb ({limit:,} bytes, what the update sent whole may hold) and {header:,} header bytes "
            "per piece")
    if in_flight:
        return Refused(429, "pieces_in_flight", f"{what}; send it again once the pieces streaming in are in, in "
                       f"{PIECE_RETRY_AFTER_S:g}s", {**wait, "limit_bytes": budget})
    return Refused(413, "pieces_too_large", f"{what}: send the update in pieces that cover it once",
                   {"limit_bytes": budget})


def sliced(model: Spec, rows: Rows) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The specs of the tensors of a piece: each model tensor's rows [start, stop)."""
    out = {}
    for name, (start, stop) in rows.items():
        dtype, shape = model[name]
        out[name] = (dtype, (stop - start, *shape[1:]) if shape else shape)
    return out


class Coverage:
    """Which rows of each model tensor the pieces in so far hold, disjoint by construction."""

    def __init__(self, model: Spec) -> None:
        self._rows = {n: (shape[0] if shape else 1) for n, (_, shape) in model.items()}
        self._row_size = {n: math.prod(shape[1:]) for n, (_, shape) in model.items()}
        self._held: dict[str, list[tuple[int, int, str]]] = {n: [] for n in model}

    def add(self, label: str, rows: Rows) -> None:
        """Take piece `label`'s rows; a piece that overlaps one in already is refused (409)."""
        for name, (start, stop) in rows.items():
            for a, b, other in self._held[name]:
                if start < b and a < stop:
                    raise Refused(409, "piece_overlaps", f"piece {label!r} holds rows [{start}, {stop}) of {name}, "
                                  f"which piece {other!r} holds in part ([{a}, {b}))", {"tensor": name})
        for name, (start, stop) in rows.items():
            self._held[name].append((start, stop, label))

    def missing(self) -> list[str]:
        """The tensors not wholly held yet."""
        return [n for n, held in self._held.items() if sum(b - a for a, b, _ in held) < self._rows[n]]

    @property
    def complete(self) -> bool:
        return not self.missing()

    def fraction(self) -> float:
        """The share of the sync set's elements the pieces in hold, from 0 to 1."""
        total = sum(rows * self._row_size[n] for n, rows in self._rows.items())
        held = sum((b - a) * self._row_size[n] for n, spans in self._held.items() for a, b, _ in spans)
        return held / total if total else 1.0

    def order(self, name: str) -> list[tuple[int, int, str]]:
        """The pieces holding `name`, by their first row."""
        return sorted(self._held[name])


@dataclass(frozen=True)
class Piece:
    path: Path
    rows: Rows
    digest: str
    length: int


@dataclass
class Partial:
    """A participant's update for a round, while its pieces come in."""

    tokens: int
    coverage: Coverage
    pieces: dict[str, Piece] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return sum(p.length for p in self.pieces.values())

    def take(self, label: str, rows: Rows, path: Path, digest: str, length: int) -> None:
        """Piece `label` (spooled at `path`) in; one overlapping a piece in is refused (409
        piece_overlaps) and nothing is taken."""
        self.coverage.add(label, rows)
        self.pieces[label] = Piece(path, dict(rows), digest, length)

    def digest(self) -> str:
        """One digest for the whole update: its pieces', by label."""
        return "pieces:" + ",".join(f"{label}={p.digest}" for label, p in sorted(self.pieces.items()))


@dataclass(frozen=True)
class PiecesIn:
    """What the status shows of an update that comes in pieces: the labels in so far, the
    share of the sync set they hold, and whether they made the whole update."""

    labels: tuple[str, ...]
    covered: float
    complete: bool

    @classmethod
    def of(cls, partial: Partial) -> PiecesIn:
        return cls(tuple(sorted(partial.pieces)), partial.coverage.fraction(), partial.coverage.complete)

    def view(self) -> dict[str, object]:
        """As the status has it (at most `SHOWN_LABELS` labels: an update may come in 256)."""
        return {"received": len(self.labels), "labels": list(self.labels[:SHOWN_LABELS]),
                "covered": math.floor(self.covered * 10_000) / 10_000,  # down: never 1 before it is whole
                "complete": self.complete}


def assemble(partial: Partial, model: Spec, out: Path) -> None:
    """Worker thread: write the update the pieces of `partial` make, plain, in the model's
    dtypes and tensor order, into `out` (a safetensors file). One piece's tensor is in
    memory at a time (a compressed one decoded)."""
    dtypes = {n: d for n, (d, _) in model.items()}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in model.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    files = {label: safe_open(str(p.path), framework="pt") for label, p in partial.pieces.items()}
    metas = {label: f.metadata() or {} for label, f in files.items()}
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, memoryview(len(raw).to_bytes(8, "little") + raw))
        for name in model:
            for _, _, label in partial.coverage.order(name):
                f = files[label]
                stored = [(k, f.get_tensor(k)) for k in parts_of(name) if k in f.keys()]  # noqa: SIM118
                shape = sliced(model, {name: partial.pieces[label].rows[name]})[name][1]
                for _, t in decompress(stored, metas[label], {name: dtypes[name]}, {name: shape}):
                    if t.numel():
                        _write_all(fd, byte_view(t.contiguous()))
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]

