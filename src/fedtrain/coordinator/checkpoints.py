"""Committed rounds on disk: the global model and the outer optimizer state per version.

File names carry the global version (`global-000012.safetensors`, `outer-000012.safetensors`);
each file is written atomically (temp file, fsync, rename, fsync of the directory) by
`fedtrain.wire.write_file`, so a file under its final name is always complete. A version
counts as committed only once the database says so; files of newer versions are orphans of
a crash between the rename and the database commit, and are removed at start.
"""

from __future__ import annotations

import concurrent.futures
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fedtrain import faults
from fedtrain.errors import StateError, WireError
from fedtrain.wire import iter_file, read_tensors, write_file
from fedtrain.wire.files import write_temp

_NAME = re.compile(r"^(global|outer)-(\d{6,})\.safetensors$")


class CheckpointDir:
    """Reads, writes and prunes the tensor files of committed rounds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def remove_temp_files(self) -> None:
        """Drop half-written files of a crashed writer (only the coordinator itself calls this)."""
        for leftover in self.root.glob("*.tmp*"):
            leftover.unlink(missing_ok=True)

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
    ) -> str:
        """Write both files of `version`; returns the global model file's digest.

        The two files are written at the same time, the outer state on a worker thread (the
        copies, the hash and the fsyncs release the GIL), so a commit takes about as long as
        the larger file. The model file is renamed into place only after the outer state
        file is: a version whose model file exists always has its optimizer state."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-ckpt") as pool:
            outer = pool.submit(self._write_outer, version, outer_tensors, outer_meta, digest_algorithm)
            try:
                pending = write_temp(self.global_path(version), params, {**run_meta, "version": str(version)},
                                     digest_algorithm)
            except BaseException:
                concurrent.futures.wait([outer])
                raise
            try:
                outer.result()
            except BaseException:
                pending.discard()
                raise
        pending.commit()
        return pending.digest

    def _write_outer(self, version: int, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                     digest_algorithm: str | None) -> None:
        write_file(self.outer_path(version), tensors, meta, digest_algorithm)
        faults.hit("checkpoint.after_outer_write", round=version - 1)

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
        self.global_path(version).unlink(missing_ok=True)
        self.outer_path(version).unlink(missing_ok=True)

    def prune(self, committed: int, keep: int, orphans: bool = True) -> None:
        """Keep the `keep` newest committed versions; drop older ones and (unless `orphans` is
        False, as when pruning runs beside a commit in progress) uncommitted orphans."""
        for v in self.versions():
            if (orphans and v > committed) or v <= committed - keep:
                self.remove(v)
