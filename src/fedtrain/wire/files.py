"""Safetensors files on disk: written atomically with their digest, read back as chunks.

Checkpoints, exported weights and initial weights are bodies stored as files. `write_file`
streams an `EncodedBody` into a temp file, fsyncs it and renames it into place (a crash
leaves the old file or the new one, never half of one); `iter_file` reads a file in chunks
for `read_tensors` or `digest_chunks`.

While a file is written, the kernel is asked (Linux's `sync_file_range`, a hint) to start
writing each 16 MiB window to disk as soon as it is copied, so the disk works while the
rest is copied and the closing fsync finds little left. Durability still comes from the
fsync alone; elsewhere the hint is skipped.

The coordinator's checkpoints are written with `direct=True` (Linux's O_DIRECT): the disk
reads each tensor straight from its memory, so the CPU copies nothing into the page cache.
That copy is a buffered commit's whole CPU time, taken from the downloads running beside it;
written direct, a commit costs a small fraction of it (figures in docs/benchmarks.md).
O_DIRECT needs block-aligned memory, offsets and lengths: a tensor whose memory lies at the
same offset from a 4 KiB boundary as its bytes in the file goes to the disk directly,
everything else (the header, small tensors, a tensor that does not line up) through an
aligned bounce buffer. The tensors that did not line up are named (`PendingFile.misfits`)
so the caller can move them (`OuterOptimizer.realign`, through `aligned_copy`, which also
asks for huge pages: the disk is then handed the memory in far fewer pieces) and write them
directly the next time. Where the file system refuses O_DIRECT, the file is written through
the page cache as above, with one warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from fedtrain import faults
from fedtrain.wire.digest import StreamingDigest
from fedtrain.wire.encode import EncodedBody
from fedtrain.wire.format import DEFAULT_CHUNK

__all__ = ["PendingFile", "iter_file", "write_file", "write_temp"]

log = logging.getLogger("fedtrain.wire")


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
        # Written direct: tensors of at least REALIGN_MIN bytes that went through the bounce
        # buffer, each with the offset from a DIRECT_ALIGN boundary its memory should have.
        self.misfits: dict[str, int] = misfits or {}

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
    digest: str | None = None,
    direct: bool = False,
) -> PendingFile:
    """The first half of `write_file`: the body in a temp file next to `path`, fsync'd.

    `reuse` names a spare file in the same directory (a temp name, owned by the caller and
    read by nobody) to write over instead of a fresh one: overwriting pages that are in the
    page cache costs about half as much as allocating new ones, and written direct, blocks the
    disk has allocated already are cheaper too. It becomes the temp file.
    `digest`, when the caller has hashed the same body already (same tensors, metadata and
    algorithm), is taken as the file's digest and the bytes are not hashed again; `""`
    for a file whose digest nobody asks for. `direct` writes it with O_DIRECT where the
    file system allows (see the module's doc)."""
    body = EncodedBody(tensors, metadata, digest_algorithm=digest_algorithm)
    path = os.fspath(path)
    opened = _open_spare(reuse) if reuse is not None else None
    if opened is None:
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    else:
        fd, tmp = opened
    written: tuple[str, dict[str, int]] | None = None
    try:
        try:
            if direct and _set_direct(fd, True):
                written = _write_direct(fd, body, digest)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _warn_direct(e)  # refused after all (alignment, file system): the page cache it is
            _set_direct(fd, False)
        if written is None:
            written = _write_buffered(fd, body, digest), {}
        os.fsync(fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return PendingFile(tmp, path, *written)


def _write_buffered(fd: int, body: EncodedBody, digest: str | None) -> str:
    """The body through the page cache from offset 0; returns its digest (`digest` if known)."""
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


DIRECT_ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths: covers 512-byte and 4 KiB blocks
BOUNCE_BYTES = 8 << 20
DIRECT_PIECE = 64 << 20  # the most one direct write hands the kernel
REALIGN_MIN = 1 << 20  # smaller tensors are not worth moving: the bounce buffer takes them


def _write_direct(fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
    """The body with O_DIRECT set on `fd`; returns its digest and the misfits (`PendingFile`)."""
    state = StreamingDigest(body.digest_algorithm) if digest is None else None
    writer = _DirectWriter(fd)
    try:
        for name, view in body.segments():
            if state is not None:
                state.update(view)
            writer.write(name, view)
        writer.finish()
    finally:
        writer.close()
    return (state.digest() if state is not None else str(digest)), writer.misfits


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _DirectWriter:
    """Writes pieces at consecutive file offsets from 0 on an O_DIRECT descriptor.

    A piece whose memory is congruent with its file offset (mod `DIRECT_ALIGN`) goes to the
    disk from where it lies, but for its unaligned head and tail; everything else is copied
    into the bounce buffer, which is written a block-aligned stretch at a time. The bounce
    buffer always holds the bytes from `start` (aligned) up to the end written so far."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # page aligned
        self.view = memoryview(self.bounce)
        self.start = 0
        self.fill = 0
        self.misfits: dict[str, int] = {}

    def write(self, name: str | None, view: memoryview) -> None:
        cursor = self.start + self.fill
        head = -cursor % DIRECT_ALIGN
        lined_up = (_address(view) - cursor) % DIRECT_ALIGN == 0
        if lined_up and view.nbytes >= head + DIRECT_ALIGN:
            self._buffer(view[:head])  # completes the bounce buffer's last block
            self._flush()
            aligned = (view.nbytes - head) // DIRECT_ALIGN * DIRECT_ALIGN
            self._pwrite(view[head : head + aligned])
            self._buffer(view[head + aligned :])
            return
        if name is not None and not lined_up and view.nbytes >= REALIGN_MIN:
            self.misfits[name] = cursor % DIRECT_ALIGN
        self._buffer(view)

    def finish(self) -> None:
        """Write what the bounce buffer holds (its last block padded), then cut the padding off."""
        size = self.start + self.fill
        padded = -self.fill % DIRECT_ALIGN
        self.view[self.fill : self.fill + padded] = bytes(padded)
        self.fill += padded
        self._flush()
        os.ftruncate(self.fd, size)  # the padding, and a longer spare's tail

    def close(self) -> None:
        try:
            self.view.release()
            self.bounce.close()
        except BufferError:
            pass  # a failed write's traceback still holds a slice: unmapped once it goes

    def _buffer(self, view: memoryview) -> None:
        pos = 0
        while pos < view.nbytes:
            n = min(BOUNCE_BYTES - self.fill, view.nbytes - pos)
            self.view[self.fill : self.fill + n] = view[pos : pos + n]
            self.fill += n
            pos += n
            if self.fill == BOUNCE_BYTES:
                self._flush()

    def _flush(self) -> None:
        if self.fill:
            self._pwrite(self.view[: self.fill])
            self.fill = 0

    def _pwrite(self, view: memoryview) -> None:
        """Write `view` (block-aligned memory and length) at `start`, and move `start` past it."""
        pos = 0
        while pos < view.nbytes:
            n = os.pwrite(self.fd, view[pos : pos + DIRECT_PIECE], self.start + pos)
            if n <= 0 or (n % DIRECT_ALIGN and pos + n < view.nbytes):
                raise OSError(errno.EIO, f"a direct write of {view.nbytes - pos} bytes wrote {n}")
            pos += n
        self.start += view.nbytes


MOVE_PIECE = 16 << 20


def aligned_copy(t: torch.Tensor, offset: int, align: int = DIRECT_ALIGN, consume: bool = False) -> torch.Tensor | None:
    """A copy of `t` whose data lies `offset` bytes past an `align` boundary (where its bytes
    lie in a file, so that `_DirectWriter` takes them from memory), backed by huge pages where
    Linux leaves them to `madvise`; None for a tensor that is not a contiguous CPU tensor, or
    whose offset does not suit its dtype.

    `consume` moves the bytes rather than copying them: `MOVE_PIECE` at a time, each piece
    of `t`'s memory given back to the system once copied (its pages then read as zeros), so
    the move costs a piece of memory, not a second tensor. Only for a tensor the caller
    owns alone and drops at once (a 1 GB embedding's momentum would otherwise need 1 GB more
    for a moment)."""
    if t.device.type != "cpu" or not t.is_contiguous() or offset % t.element_size():
        return None
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    _huge_pages(raw.data_ptr(), nbytes + align)
    shift = (offset - raw.data_ptr()) % align  # a multiple of the element size: torch aligns to 64
    moved = raw[shift : shift + nbytes].view(t.dtype).view(t.shape)
    if not consume:
        moved.copy_(t)
        return moved
    src, dst = t.reshape(-1).view(torch.uint8), moved.reshape(-1).view(torch.uint8)
    released = src.data_ptr() + -src.data_ptr() % PAGE  # the first whole page of t
    for start in range(0, nbytes, MOVE_PIECE):
        end = min(start + MOVE_PIECE, nbytes)
        dst[start:end].copy_(src[start:end])
        copied = (src.data_ptr() + end) // PAGE * PAGE
        if copied > released:
            _release(released, copied - released)
            released = copied
    return moved


HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14


def _release(address: int, nbytes: int) -> None:
    """Give whole pages of memory that nobody will read back to the system (a no-op elsewhere)."""
    madvise = _madvise()
    if madvise is not None:
        madvise(address, nbytes, _MADV_DONTNEED)


def _huge_pages(address: int, nbytes: int) -> None:
    """Ask for huge pages behind the whole 2 MiB pages of a fresh, untouched allocation (a hint).
    A direct write then hands the disk the memory in far fewer pieces than from 4 KiB pages,
    and is faster for it."""
    madvise = _madvise()
    start = -address % HUGE_PAGE + address
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False where there is no such thing or it is refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        import fcntl

        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except (ImportError, OSError) as e:
        if on:
            _warn_direct(e)
        return False
    return True


_warned_direct = False


def _warn_direct(error: BaseException) -> None:
    global _warned_direct
    if not _warned_direct:
        _warned_direct = True
        log.warning("files cannot be written with O_DIRECT here (%s); writing them through the page cache", error)


WRITEBACK_WINDOW = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


def _linux_libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
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
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, or None where there is none."""
    return _linux_libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    return _linux_libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


class _Writeback:
    """Start the disk write of each full window of a file as it is written (a hint; see above)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.fn = _sync_file_range()
        self.written = 0
        self.started = 0  # bytes [0, started) were handed to writeback

    def wrote(self, n: int) -> None:
        self.written += n
        if self.fn is None or self.written - self.started < WRITEBACK_WINDOW:
            return
        if self.fn(self.fd, self.started, self.written - self.started, _SYNC_FILE_RANGE_WRITE) != 0:
            self.fn = None  # e.g. a file system without it: the fsync then does all the work
        self.started = self.written


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
