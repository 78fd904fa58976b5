"""Safetensors files on disk: written atomically with their digest, read back as chunks.

Checkpoints, exported weights and initial weights are bodies stored as files. `write_file`
streams an `EncodedBody` into a temp file, fsyncs it and renames it into place (a crash
leaves the old file or the new one, never half of one); `iter_file` reads a file in chunks
for `read_tensors` or `digest_chunks`.

While a file is written, the kernel is asked (Linux's `sync_file_range`, a hint) to start
writing each 16 MiB window to disk as soon as it is copied, so the disk works while the
rest is copied and the closing fsync finds little left. Durability still comes from the
fsync alone; elsewhere the hint is skipped.

How the bytes go into the temp file is the caller's choice (`write_temp(write=...)`): by
default through the page cache (`write_buffered`); the coordinator's checkpoints pass a
writer of the transport seam (`fedtrain.transport.writers`), which may write them with
O_DIRECT and name the tensors it could not take from memory (`PendingFile.misfits`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fedtrain import faults
from fedtrain.wire.digest import StreamingDigest
from fedtrain.wire.encode import EncodedBody
from fedtrain.wire.format import DEFAULT_CHUNK

__all__ = ["FileWrite", "PendingFile", "iter_file", "write_buffered", "write_file", "write_temp"]

FileWrite = Callable[[int, EncodedBody, "str | None"], "tuple[str, dict[str, int]]"]
"""Writes a body into an open file from offset 0 (cutting off what lay beyond), returns its
digest (the one given, if any) and the misfits (`PendingFile.misfits`); the caller fsyncs."""


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

    def __init__(self, tmp: str, path: str, digest: str, misfits: dict[str, int] | None = None) -> None:
        self.tmp, self.path, self.digest = tmp, path, digest
        # What the writer could not take from memory (`FileWrite`): tensors by name, each with
        # the offset (mod the writer's alignment) its memory should have. Empty when buffered.
        self.misfits: dict[str, int] = misfits or {}

    def commit(self) -> None:
        """Rename it into place and make the rename durable."""
        try:
            faults.hit("file.before_rename")
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def discard(self) -> None:
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def write_temp(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    digest_algorithm: str | None = None,
    reuse: str | os.PathLike[str] | None = None,
    digest: str | None = None,
    write: FileWrite | None = None,
) -> PendingFile:
    """The first half of `write_file`: the body in a temp file next to `path`, fsync'd.

    `reuse` names a spare file in the same directory (a temp name, owned by the caller and
    read by nobody) to write over instead of a fresh one: overwriting pages that are in the
    page cache costs less than allocating new ones, and written direct, blocks the disk has
    allocated already are cheaper too. It becomes the temp file.
    `digest`, when the caller has hashed the same body already (same tensors, metadata and
    algorithm), is taken as the file's digest and the bytes are not hashed again; `""`
    for a file whose digest nobody asks for. `write` puts the bytes into the file (None:
    `write_buffered`, through the page cache; see the module's doc)."""
    body = EncodedBody(tensors, metadata, digest_algorithm=digest_algorithm)
    path = os.fspath(path)
    opened = _open_spare(reuse) if reuse is not None else None
    if opened is None:
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    else:
        fd, tmp = opened
    try:
        written = (write or _buffered)(fd, body, digest)
        os.fsync(fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return PendingFile(tmp, path, *written)


def write_buffered(fd: int, body: EncodedBody, digest: str | None) -> str:
    """The body through the page cache from offset 0 of `fd`, to its end (a longer file is cut);
    returns its digest (`digest` if known). The caller fsyncs."""
    state = StreamingDigest(body.digest_algorithm) if digest is None else None
    with os.fdopen(fd, "wb", closefd=False) as f:
        f.seek(0)
        writeback = _Writeback(fd)
        for chunk in body:
            if state is not None:
                state.update(chunk)
            f.write(chunk)
            writeback.wrote(len(chunk))
        f.truncate()  # a longer spare's tail goes
    return state.digest() if state is not None else str(digest)


def _buffered(fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
    return write_buffered(fd, body, digest), {}


WRITEBACK_WINDOW = 16 << 20
SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


def linux_libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A function of Linux's libc returning int, or None where there is none (not Linux, no libc found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


@functools.cache
def sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, or None where there is none."""
    return linux_libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


class _Writeback:
    """Start the disk write of each full window of a file as it is written (a hint; see above)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.fn = sync_file_range()
        self.written = 0
        self.started = 0  # bytes [0, started) were handed to writeback

    def wrote(self, n: int) -> None:
        self.written += n
        if self.fn is None or self.written - self.started < WRITEBACK_WINDOW:
            return
        if self.fn(self.fd, self.started, self.written - self.started, SYNC_FILE_RANGE_WRITE) != 0:
            self.fn = None  # e.g. a file system without it: the fsync then does all the work
        self.started = self.written


def _open_spare(path: str | os.PathLike[str]) -> tuple[int, str] | None:
    """Open a spare file for writing over its cached pages (no O_TRUNC); None when it is gone."""
    try:
        return os.open(path, os.O_WRONLY), os.fspath(path)
    except FileNotFoundError:
        return None


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a rename or a new file in it is durable (a no-op off POSIX)."""
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
