"""Committed rounds on disk: the global model and the outer optimizer state per version.

File names carry the global version (`global-000012.safetensors`, `outer-000012.safetensors`);
each file is written atomically (temp file, fsync, rename, fsync of the directory) by
`fedtrain.wire.write_file`, so a file under its final name is always complete. A version
counts as committed only once the database says so; files of newer versions are orphans of
a crash between the rename and the database commit, and are removed at start.

The files are written with O_DIRECT (`write_temp(direct=True)`): the disk takes the tensors
from memory, and the CPU, which the round's downloads need at the same time, copies nothing
into the page cache. `write` names the tensors that were not placed in memory for that
(`Written`), and the coordinator moves them (`OuterOptimizer.realign`) after the first commit.

Pruned files are kept as spares (up to two, under temp names) and the next checkpoint is
written over them: blocks the disk has allocated already are written faster than fresh
ones, whose blocks it must allocate first (figures in docs/benchmarks.md). A file is made a
spare only while no download reads it (`open_reader` counts readers); one still being read
is unlinked instead, which its open descriptor survives. So the directory holds the kept
versions plus at most two spare files; a restart removes them with the other temp files.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from fedtrain import faults
from fedtrain.errors import StateError, WireError
from fedtrain.wire import iter_file, read_tensors
from fedtrain.wire.files import write_temp

_NAME = re.compile(r"^(global|outer)-(\d{6,})\.safetensors$")
SPARES = 2  # one round writes two files


@dataclass
class Written:
    """What `CheckpointDir.write` wrote: the model file's digest, and the tensors of each file
    that went to the disk through the bounce buffer (`PendingFile.misfits`)."""

    digest: str
    misfits: dict[str, int]
    state_misfits: dict[str, int]


class CheckpointDir:
    """Reads, writes and prunes the tensor files of committed rounds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        # Readers, spares and their names change on the event loop (downloads), the commit
        # thread (taking spares) and the janitor (pruning): all under this lock.
        self._lock = threading.Lock()
        self._readers: collections.Counter[Path] = collections.Counter()
        self._spares: list[Path] = []
        self._spare_names = 0

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
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-ckpt") as pool:
            outer = pool.submit(self._write_outer, version, outer_tensors, outer_meta, digest_algorithm)
            try:
                pending = write_temp(self.global_path(version), params, {**run_meta, "version": str(version)},
                                     digest_algorithm, reuse=self._take_spare(), digest=digest, direct=True)
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

    def _write_outer(self, version: int, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                     digest_algorithm: str | None) -> dict[str, int]:
        # Nothing checks this file's digest (the model file's names the version): not hashed.
        pending = write_temp(self.outer_path(version), tensors, meta, digest_algorithm, reuse=self._take_spare(),
                             digest="", direct=True)
        pending.commit()
        faults.hit("checkpoint.after_outer_write", round=version - 1)
        return pending.misfits

    def load_global(self, version: int, digest: str | None) -> dict[str, torch.Tensor]:
        return self._load(self.global_path(version), digest)

    def load_outer(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        path = self.outer_path(version)
        tensors = self._load(path, None)
        from safetensors import safe_open  # header-only read for the metadata

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return tensors, dict(meta)

    def _load(self, path: Path, digest: str | None) -> dict[str, torch.Tensor]:
        if not path.is_file():
            raise StateError(f"checkpoint {path} is missing; the state directory is damaged")
        try:
            return dict(read_tensors(iter_file(path), expected_digest=digest))
        except WireError as e:
            raise StateError(f"checkpoint {path} is damaged: {e.message}") from None

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
