"""The spool: every file an update lives in on the coordinator. `SpoolFiles` hands out and
reuses the files uploads stream into, `Staging` reads a verified file back (mapped 16 MiB
pieces, or whole tensors), and `RoundSpool` keeps the round's files until the close for the
aggregators that need every update at once. More: docs/architecture.md, "coordinator/intake/spool.py"."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from fedtrain.config import OuterConfig
from fedtrain.errors import WireError
from fedtrain.merge import RunningSum
from fedtrain.merge.robust import aggregate_tensor, clip_scale, norm_outliers, sum_of_squares
from fedtrain.wire import TensorSpec, iter_file, parse_header, read_tensors
from fedtrain.wire.compress import decode_parts, decompress, parts_of

log = logging.getLogger("fedtrain.coordinator")

_PREFIX = 8


class SpoolFiles:
    """Spool files for uploads, reused from one upload to the next.

    Overwriting a file whose pages are in the page cache is about twice as fast as writing a
    fresh one (no page allocation), and there is no unlink to pay: the directory holds one
    file per upload that was ever in flight at once. Used from the event loop only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._free: list[Path] = []
        self._made = 0

    def take(self) -> tuple[Path, bool]:
        """A file to spool the next upload into, and whether it is new."""
        if self._free:
            return self._free.pop(), False
        self._made += 1
        return self.root / f"upload-{self._made}.spool", True

    def give_back(self, path: Path) -> None:
        """Return a file for reuse (one moved away, e.g. kept for a robust aggregator, is not)."""
        if path.exists():
            self._free.append(path)

    def discard(self, path: Path, new: bool) -> None:
        """After a refused upload: its bytes go; the directory is left as the upload found it."""
        if new:
            path.unlink(missing_ok=True)
        elif path.exists():
            os.truncate(path, 0)
            self._free.append(path)


PIECE_BYTES = 16 << 20


class Staging:
    """Reads verified spool files back: in mapped pieces of at most `PIECE_BYTES`, or whole.

    A plain (uncompressed) body is read in pieces of whole elements, so checking and folding
    an upload map 16 MiB, not its largest tensor (an LLM's embedding can be a GB). A
    compressed body is decoded a whole tensor at a time, into fresh memory."""

    def __init__(self, nbytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = max(nbytes, 64)
        self._buffer: torch.Tensor | None = None  # where pieces are read when mapping fails

    def header(self, path: Path) -> tuple[list[TensorSpec], dict[str, str]]:
        with open(path, "rb") as f:
            return _read_header(f)

    def pieces(self, path: Path) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(name, index of its first element, values) of a verified spool file, in file
        order; each piece is a flat view of the file's pages, mapped (copy on write: the
        file never changes), and unmapped once the caller lets go of it. Where the file
        cannot be mapped (a file system without mmap) pieces are read into one buffer
        instead, each valid until the next."""
        with open(path, "rb", buffering=0) as f:
            order, _ = _read_header(f)
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
            for spec in order:
                if offset + spec.nbytes > size:  # a mapped page past the end would be a SIGBUS, not an error
                    raise WireError(f"spool file ended inside tensor {spec.name!r}")
                per_piece = max(1, self.piece_bytes // spec.dtype.itemsize)
                if spec.numel == 0:
                    yield spec.name, 0, torch.empty(0, dtype=spec.dtype)
                for start in range(0, spec.numel, per_piece):
                    nbytes = min(per_piece, spec.numel - start) * spec.dtype.itemsize
                    yield spec.name, start, self._piece(f, offset, nbytes, spec.name).view(spec.dtype)
                    offset += nbytes

    def _piece(self, f: BinaryIO, offset: int, nbytes: int, name: str) -> torch.Tensor:
        if self._buffer is None:
            try:
                return _mapped(f.fileno(), offset, nbytes)
            except (OSError, ValueError) as e:
                log.warning("spool files cannot be mapped here (%s); reading them back through a buffer", e)
                self._buffer = torch.empty(self.piece_bytes, dtype=torch.uint8)
        piece = self._buffer[:nbytes]
        f.seek(offset)
        _readinto(f, memoryview(piece.numpy()), name)  # type: ignore[arg-type]
        return piece

    def tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of a verified spool file, each read whole into fresh memory."""
        with open(path, "rb", buffering=0) as f:
            order, _ = _read_header(f)
            for spec in order:
                t = torch.empty(spec.shape, dtype=spec.dtype)
                if spec.nbytes:
                    _readinto(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()), spec.name)  # type: ignore[arg-type]
                yield spec.name, t

    def decoded(self, path: Path, dtypes: Mapping[str, torch.dtype],
                metadata: Mapping[str, str] | None = None,
                shapes: Mapping[str, tuple[int, ...]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors of a verified spool file (compressed bodies decoded), one at a time;
        pass the header's `metadata` when it was read already, and the model's `shapes` for a
        body whose tensors do not carry them (e3m0, topk)."""
        meta = self.header(path)[1] if metadata is None else metadata
        return decompress(self.tensors(path), meta, dtypes, shapes)

    def sparse(self, path: Path, dtypes: Mapping[str, torch.dtype], metadata: Mapping[str, str],
               shapes: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor]]:
        """The tensors of a verified spool file as `decode_parts` gives them: a topk tensor as its
        flat positions and values (never densified), any other decoded whole."""
        return decode_parts(self.tensors(path), metadata, dtypes, shapes)


def _mapped(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of a file as a tensor over its mapped pages; the mapping
    lives as long as the tensor does."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset - start)


def _read_header(f: object) -> tuple[list[TensorSpec], dict[str, str]]:
    n = int.from_bytes(_read_exact(f, _PREFIX), "little")
    return parse_header(_read_exact(f, n))


def _readinto(f: object, view: memoryview, name: str) -> None:
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise WireError(f"spool file ended inside tensor {name!r}")
        got += n


def _read_exact(f: object, n: int) -> bytes:
    data = f.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise WireError("spool file is truncated")
    return data


@dataclass(frozen=True)
class SpoolEntry:
    key: str  # the participant id, or "pid@lateR" for a late update from round R
    path: Path
    weight: float  # the fold weight: tokens (or 1) times any staleness discount
    norm: float  # the update's L2 norm over all its tensors


Shapes = Mapping[str, tuple[int, ...]]


def iter_update(path: Path, dtypes: Mapping[str, torch.dtype],
                shapes: Shapes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of a verified spool file, one at a time (compressed bodies decoded;
    `shapes`: the model's, for e3m0 and topk bodies)."""
    meta: dict[str, str] = {}
    tensors = read_tensors(iter_file(path), on_header=lambda _, m: meta.update(m))
    yield from decompress(tensors, meta, dtypes, shapes)


def update_norm_of_file(path: Path, dtypes: Mapping[str, torch.dtype], shapes: Shapes | None = None) -> float:
    """The L2 norm of a spooled update over all its (decoded) tensors."""
    return math.sqrt(sum(sum_of_squares(t) for _, t in iter_update(path, dtypes, shapes)))


def _tensor(f: Any, meta: Mapping[str, str], name: str, dtype: torch.dtype,
            shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """One decoded tensor of an open safetensors file, read on its own (memory: that tensor)."""
    pieces = [(k, f.get_tensor(k)) for k in parts_of(name) if k in f.keys()]  # noqa: SIM118
    for _, t in decompress(pieces, meta, {name: dtype}, None if shape is None else {name: shape}):
        return t
    raise KeyError(name)


class RoundSpool:
    """Retained, verified updates of one open round."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: dict[str, SpoolEntry] = {}

    def keep(self, key: str, verified: Path, round_: int, weight: float, norm: float) -> SpoolEntry:
        """Move a verified spool file into the round's directory and remember it."""
        folder = self.root / f"round-{round_}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{key}.safetensors"
        verified.replace(path)
        entry = SpoolEntry(key, path, weight, norm)
        self.entries[key] = entry
        return entry

    def clear(self) -> None:
        for entry in self.entries.values():
            entry.path.unlink(missing_ok=True)
        self.entries = {}
        for folder in self.root.glob("round-*"):
            shutil.rmtree(folder, ignore_errors=True)

    def aggregate_into(self, acc: RunningSum, outer: OuterConfig, dtypes: Mapping[str, torch.dtype],
                       shapes: Shapes | None = None) -> dict[str, str]:
        """Fold the round's robust aggregate into `acc` (no entries: nothing to do); returns the
        keys left out as norm outliers, each with its reason. `shapes`: the model's (e3m0 and
        topk bodies are decoded whole here, a tensor at a time)."""
        if not self.entries:
            return {}
        rejected = norm_outliers({k: e.norm for k, e in self.entries.items()}, outer.outlier_factor)
        kept = [e for k, e in self.entries.items() if k not in rejected]
        if outer.aggregator == "mean":
            for e in kept:
                scale = clip_scale(e.norm, outer.clip_norm)
                for name, tensor in iter_update(e.path, dtypes, shapes):
                    acc.fold(name, tensor, e.weight * scale)
                acc.finish_contribution(e.weight)
            return rejected
        scales = [clip_scale(e.norm, outer.clip_norm) for e in kept]
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(safe_open(str(e.path), framework="pt")) for e in kept]
            metas = [f.metadata() or {} for f in files]
            for name, dtype in dtypes.items():
                shape = () if shapes is None else (shapes[name],)  # e3m0 and topk bodies need it
                stack_k = [_tensor(f, m, name, dtype, *shape) * s for f, m, s in zip(files, metas, scales, strict=True)]
                acc.fold(name, aggregate_tensor(stack_k, outer.aggregator, outer.trim_fraction), 1.0)
                del stack_k
        acc.finish_contribution(1.0)
        return rejected
