"""Safetensors files on disk: written atomically with their digest, read back as chunks.

Checkpoints, exported weights and initial weights are bodies stored as files. `write_file`
streams an `EncodedBody` into a temp file, fsyncs it and renames it into place (a crash
leaves the old file or the new one, never half of one); `iter_file` reads a file in chunks
for `read_tensors` or `digest_chunks`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping

import torch

from fedtrain import faults
from fedtrain.wire.digest import StreamingDigest
from fedtrain.wire.encode import EncodedBody
from fedtrain.wire.format import DEFAULT_CHUNK

__all__ = ["PendingFile", "iter_file", "write_file", "write_temp"]


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    digest_algorithm: str | None = None,
) -> str:
    """Write a safetensors file atomically (temp file, fsync, rename); return its digest."""
    pending = write_temp(path, tensors, metadata, digest_algorithm)
    pending.commit()
    return pending.digest


class PendingFile:
    """A fully written and fsync'd temp file, not yet under its final name."""

    def __init__(self, tmp: str, path: str, digest: str) -> None:
        self.tmp, self.path, self.digest = tmp, path, digest

    def commit(self) -> None:
        """Rename it into place and make the rename durable."""
        try:
            faults.hit("file.before_rename")
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def discard(self) -> None:
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def write_temp(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    digest_algorithm: str | None = None,
    reuse: str | os.PathLike[str] | None = None,
) -> PendingFile:
    """The first half of `write_file`: the body in a temp file next to `path`, fsync'd.

    `reuse` names a spare file in the same directory (a temp name, owned by the caller and
    read by nobody) to write over instead of a fresh one: overwriting pages that are in the
    page cache costs about half as much as allocating new ones. It becomes the temp file."""
    body = EncodedBody(tensors, metadata, digest_algorithm=digest_algorithm)
    path = os.fspath(path)
    opened = _open_spare(reuse) if reuse is not None else None
    if opened is None:
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    else:
        fd, tmp = opened
    state = StreamingDigest(body.digest_algorithm)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in body:
                state.update(chunk)
                f.write(chunk)
            f.truncate()  # a longer spare's tail goes
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return PendingFile(tmp, path, state.digest())


def _open_spare(path: str | os.PathLike[str]) -> tuple[int, str] | None:
    """Open a spare file for writing over its cached pages (no O_TRUNC); None when it is gone."""
    try:
        return os.open(path, os.O_WRONLY), os.fspath(path)
    except FileNotFoundError:
        return None


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
