"""Committed rounds on disk: the global model and the outer optimizer state per version.

File names carry the global version (`global-000012.safetensors`, `outer-000012.safetensors`,
and with compressed downloads the coordinator's error feedback `residual-000012.safetensors`);
each file is written atomically (temp file, fsync, rename, fsync of the directory) by
`fedtrain.wire.write_file`, so a file under its final name is always complete. A version
counts as committed only once the database says so; files of newer versions are orphans of
a crash between the rename and the database commit, and are removed at start.

More: docs/architecture.md, "coordinator/model/checkpoints.py".
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from fedtrain import faults
from fedtrain.errors import StateError, WireError
from fedtrain.transport import writers
from fedtrain.wire import EncodedBody, StreamingDigest, iter_file, read_tensors
from fedtrain.wire.digest import digests_equal, parse_digest
from fedtrain.wire.files import write_temp
from fedtrain.wire.format import MAX_HEADER_BYTES, parse_header
from fedtrain.wire.reader import OnHeader

if TYPE_CHECKING:
    from fedtrain.merge.outer import OuterOptimizer

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(global|outer|residual)-(\d{6,})\.safetensors$")
SPARES = 2  # one round writes two files
STATE_DIGEST_KEY = "fedtrain.state_digest"
"""Metadata key of an outer state file: the digest of the file's body without this key."""


@dataclass
class Written:
    """What `CheckpointDir.write` wrote: the model file's digest, and the tensors of each file
    that the writer could not take from memory (`PendingFile.misfits`; empty when buffered)."""

    digest: str
    misfits: dict[str, int]
    state_misfits: dict[str, int]


class CheckpointDir:
    """Reads, writes and prunes the tensor files of committed rounds. `fast_io` picks the
    writer (O_DIRECT or the page cache; None: `FEDTRAIN_FAST_IO` decides)."""

    def __init__(self, root: Path, fast_io: bool | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._writer = writers.checkpoint_writer(fast_io)
        # Readers, spares and their names change on the event loop (downloads), the commit
        # thread (taking spares) and the janitor (pruning): all under this lock.
        self._lock = threading.Lock()
        self._readers: collections.Counter[Path] = collections.Counter()
        self._spares: list[Path] = []
        self._spare_names = 0
        self._unverified: set[str] = set()  # names of outer files loaded without a digest

    def remove_temp_files(self) -> None:
        """Drop half-written files of a crashed writer, and spares (only the coordinator itself calls this)."""
        with self._lock:
            self._spares.clear()
        for leftover in self.root.glob("*.tmp*"):
            leftover.unlink(missing_ok=True)

    def open_reader(self, path: Path) -> BinaryIO:
        """Open a checkpoint file for a download; while it is open the file is never a spare."""
        with self._lock:
            f = open(path, "rb")  # noqa: SIM115 - closed by close_reader
            self._readers[path] += 1
        return f

    @property
    def open_readers(self) -> int:
        """How many checkpoint files downloads hold open now."""
        with self._lock:
            return sum(self._readers.values())

    def close_reader(self, path: Path, f: BinaryIO) -> None:
        f.close()
        with self._lock:
            self._readers[path] -= 1
            if self._readers[path] <= 0:
                del self._readers[path]

    def _take_spare(self) -> Path | None:
        with self._lock:
            return self._spares.pop() if self._spares else None

    def global_path(self, version: int) -> Path:
        return self.root / f"global-{version:06d}.safetensors"

    def outer_path(self, version: int) -> Path:
        return self.root / f"outer-{version:06d}.safetensors"

    def residual_path(self, version: int) -> Path:
        return self.root / f"residual-{version:06d}.safetensors"

    def write_residual(self, version: int, tensors: dict[str, torch.Tensor], digest_algorithm: str | None) -> None:
        """The compressed downloads' error feedback of `version` (`wire/delta.py`), atomically and
        with the digest of its body; written before the version's model file, so a version whose
        model file exists has its residual (if it had one)."""
        claimed = EncodedBody(tensors, {}, digest_algorithm=digest_algorithm).digest()
        write_temp(self.residual_path(version), tensors, {STATE_DIGEST_KEY: claimed}, digest_algorithm,
                   digest="").commit()

    def load_residual(self, version: int) -> dict[str, torch.Tensor] | None:
        """The residual of `version`, verified; None when there is none or it does not verify
        (logged): losing it costs the signal it held back, never the bit-identity of the weights."""
        path = self.residual_path(version)
        if not path.is_file():
            return None
        meta: dict[str, str] = {}
        try:
            tensors = self._load(path, None, on_header=lambda _specs, m: meta.update(m))
            claimed = meta.get(STATE_DIGEST_KEY, "")
            got = EncodedBody(tensors, {}, digest_algorithm=parse_digest(claimed)[0]).digest()
        except (StateError, WireError) as e:
            log.warning("residual %s cannot be read (%s): compressed downloads restart with none", path, e)
            return None
        if not digests_equal(got, claimed):
            log.warning("residual %s does not match its digest: compressed downloads restart with none", path)
            return None
        return tensors

    def write(
        self,
        version: int,
        params: dict[str, torch.Tensor],
        outer_tensors: dict[str, torch.Tensor],
        outer_meta: dict[str, str],
        run_meta: dict[str, str],
        digest_algorithm: str | None = None,
        digest: str | None = None,
    ) -> Written:
        """Write both files of `version`; returns the global model file's digest (`digest`,
        when the caller hashed the same body already: the bytes are then not hashed again)
        and the misfits of both files.

        The two files are written at the same time, the outer state on a worker thread (the
        copies, the hash and the fsyncs release the GIL), so a commit takes about as long as
        the larger file. The model file is renamed into place only after the outer state
        file is: a version whose model file exists always has its optimizer state."""
        write = self._writer.write
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-ckpt") as pool:
            outer = pool.submit(self._write_outer, version, outer_tensors, outer_meta, digest_algorithm)
            try:
                pending = write_temp(self.global_path(version), params, {**run_meta, "version": str(version)},
                                     digest_algorithm, reuse=self._take_spare(), digest=digest, write=write)
            except BaseException:
                concurrent.futures.wait([outer])
                raise
            try:
                state_misfits = outer.result()
            except BaseException:
                pending.discard()
                raise
        pending.commit()
        return Written(pending.digest, pending.misfits, state_misfits)

    def realign(self, outer: OuterOptimizer, written: Written) -> None:
        """Move the tensors of `outer` that `written` names (the misfits of its last `write`) to
        where the writer takes them from memory next time; values unchanged. The caller holds
        off every reader and writer of `outer`'s tensors meanwhile, and makes sure that no other
        optimizer shares its state (the state's old memory is given back as it is moved)."""
        if written.misfits or written.state_misfits:
            writers.realign(outer, self._writer, written.misfits, written.state_misfits)

    def _write_outer(self, version: int, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                     digest_algorithm: str | None) -> dict[str, int]:
        if STATE_DIGEST_KEY in meta:
            raise StateError(f"outer optimizer metadata may not use the key {STATE_DIGEST_KEY!r}")
        # One hash pass over the state in memory (on this worker thread; the hash releases the
        # GIL); the file's own bytes, which hold the result, are then not hashed.
        claimed = EncodedBody(tensors, meta, digest_algorithm=digest_algorithm).digest()
        pending = write_temp(self.outer_path(version), tensors, {**meta, STATE_DIGEST_KEY: claimed},
                             digest_algorithm, reuse=self._take_spare(), digest="", write=self._writer.write)
        pending.commit()
        faults.hit("checkpoint.after_outer_write", round=version - 1)
        return pending.misfits

    def load_global(self, version: int, digest: str | None) -> dict[str, torch.Tensor]:
        return self._load(self.global_path(version), digest)

    def run_metadata(self, version: int) -> dict[str, str]:
        """The metadata `version`'s model file carries (its header only; unverified: the caller
        takes it as a record, the weights are verified on load), {} when it cannot be read."""
        try:
            with open(self.global_path(version), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                return parse_header(f.read(n))[1] if 0 < n <= MAX_HEADER_BYTES else {}
        except (OSError, WireError):
            return {}

    def load_outer(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The outer optimizer state of `version` and its metadata, verified against the digest
        the file carries (`STATE_DIGEST_KEY`, not part of the metadata returned)."""
        path = self.outer_path(version)
        meta: dict[str, str] = {}
        tensors = self._load(path, None, on_header=lambda _specs, m: meta.update(m))
        claimed = meta.pop(STATE_DIGEST_KEY, None)
        if claimed is None:
            self._accept_unverified(path, tensors)
            return tensors, meta
        try:
            got = EncodedBody(tensors, meta, digest_algorithm=parse_digest(claimed)[0]).digest()
            same = digests_equal(got, claimed)
        except WireError as e:
            raise StateError(f"checkpoint {path} is damaged on disk: its {STATE_DIGEST_KEY} is unusable "
                             f"({e.message})") from None
        if not same:
            raise StateError(_damaged(path, claimed, got))
        return tensors, meta

    def unverified(self) -> list[str]:
        """Names of the outer state files loaded without a digest (written by an older fedtrain)."""
        with self._lock:
            return sorted(self._unverified)

    def _accept_unverified(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        # No digest to check: at least the values that would make the next model non-finite.
        for name, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
                raise StateError(f"checkpoint {path} is damaged on disk: tensor {name!r} holds non-finite "
                                 "values (the file carries no digest, written by an older fedtrain)")
        log.warning("checkpoint %s carries no digest (written by an older fedtrain): loaded unverified; "
                    "the next commit writes the optimizer state with one", path)
        with self._lock:
            self._unverified.add(path.name)

    def _load(self, path: Path, digest: str | None, on_header: OnHeader | None = None) -> dict[str, torch.Tensor]:
        if not path.is_file():
            raise StateError(f"checkpoint {path} is missing; the state directory is damaged")
        state = StreamingDigest.like(digest) if digest is not None else None
        try:
            tensors = dict(read_tensors(_hashed(iter_file(path), state), on_header=on_header))
        except WireError as e:
            raise StateError(f"checkpoint {path} is damaged on disk: {e.message}") from None
        if state is not None and digest is not None and not digests_equal(state.digest(), digest):
            raise StateError(_damaged(path, digest, state.digest()))
        return tensors

    def versions(self) -> list[int]:
        found = set()
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.add(int(m.group(2)))
        return sorted(found)

    def remove(self, version: int) -> None:
        """Drop both files of `version`: kept as spares while fewer than `SPARES` are, and
        nobody reads them; else unlinked."""
        self.residual_path(version).unlink(missing_ok=True)  # never a spare: only some runs write one
        for path in (self.global_path(version), self.outer_path(version)):
            with self._lock:
                if len(self._spares) < SPARES and not self._readers[path] and path.is_file():
                    self._spare_names += 1
                    spare = self.root / f".spare-{self._spare_names}.tmp"
                    os.replace(path, spare)  # not durable, nor need it be: either name is cleaned up
                    self._spares.append(spare)
                    continue
            path.unlink(missing_ok=True)

    def prune(self, committed: int, keep: int, orphans: bool = True) -> None:
        """Keep the `keep` newest committed versions; drop older ones and (unless `orphans` is
        False, as when pruning runs beside a commit in progress) uncommitted orphans."""
        for v in self.versions():
            if (orphans and v > committed) or v <= committed - keep:
                self.remove(v)


def _hashed(chunks: Iterator[bytes], state: StreamingDigest | None) -> Iterator[bytes]:
    for chunk in chunks:
        if state is not None:
            state.update(chunk)
        yield chunk


def _damaged(path: Path, expected: str, got: str) -> str:
    return (f"checkpoint {path} is damaged on disk: its content does not match the digest it was written "
            f"with (expected {expected}, got {got}); restore the state directory from a backup, or start "
            "from an older version")
