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

__all__ = ["iter_file", "write_file"]


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
