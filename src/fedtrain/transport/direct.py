"""The fast checkpoint writer: `DirectWriter` writes a file with Linux's O_DIRECT, so the disk
reads each tensor straight from its memory and the CPU copies nothing into the page cache.

That copy is a buffered commit's whole CPU time, taken from the downloads running beside
it (figures in docs/benchmarks.md). O_DIRECT needs block-aligned memory, offsets and
lengths: a tensor whose memory lies at the same offset from a 4 KiB boundary as its bytes
in the file goes to the disk directly, everything else (the header, small tensors, a
tensor that does not line up) through an aligned bounce buffer. The tensors that did not
line up are returned as misfits, so that the caller can have them moved (`place`, through
`aligned_copy`, which also asks for huge pages: the disk is then handed the memory in far
fewer pieces) and written directly the next time. Where the file system refuses O_DIRECT,
the file is written through the page cache (`wire.files.write_buffered`), with one warning.
The plain path beside it is `writers.BufferedWriter`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedtrain.wire.digest import StreamingDigest
from fedtrain.wire.encode import EncodedBody
from fedtrain.wire.files import linux_libc, write_buffered

__all__ = ["DIRECT_ALIGN", "DirectWriter", "aligned_copy", "o_direct_supported"]

log = logging.getLogger("fedtrain.wire")


class DirectWriter:
    """A `CheckpointWriter` that writes with O_DIRECT where the file system allows (the fast path)."""

    def __init__(self) -> None:
        self._warned = False  # about a file system that refuses O_DIRECT: once per writer

    def write(self, fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
        """`body` into `fd` with O_DIRECT; through the page cache where that is refused (no misfits then)."""
        try:
            direct = _set_direct(fd, True)
        except OSError as e:
            direct = False
            self._warn(e)
        if direct:
            try:
                return _write_direct(fd, body, digest)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._warn(e)  # refused after all (alignment, file system): the page cache it is
                _set_direct(fd, False)
        return write_buffered(fd, body, digest), {}

    def place(self, t: torch.Tensor, offset: int, consume: bool = False) -> torch.Tensor | None:
        """`aligned_copy(t, offset, consume=consume)`: where the next write takes `t` from memory."""
        return aligned_copy(t, offset, DIRECT_ALIGN, consume)

    def _warn(self, error: object) -> None:
        if not self._warned:
            self._warned = True
            log.warning("files cannot be written with O_DIRECT here (%s); writing them through the page cache", error)


def o_direct_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in `directory` take O_DIRECT (a probe file, removed at once)."""
    probe = Path(directory) / f".o_direct-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        return _set_direct(fd, True)
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


DIRECT_ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths: covers 512-byte and 4 KiB blocks
BOUNCE_BYTES = 8 << 20
DIRECT_PIECE = 64 << 20  # the most one direct write hands the kernel
REALIGN_MIN = 1 << 20  # smaller tensors are not worth moving: the bounce buffer takes them


def _write_direct(fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
    """The body with O_DIRECT set on `fd`; returns its digest and the misfits (`DirectWriter.write`)."""
    state = StreamingDigest(body.digest_algorithm) if digest is None else None
    writer = _AlignedWrites(fd)
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


class _AlignedWrites:
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
    lie in a file, so that `DirectWriter` takes them from memory), backed by huge pages where
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
    """Turn O_DIRECT on or off for `fd`; False where there is no such thing (not Linux).
    Raises OSError where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    try:
        import fcntl
    except ImportError:
        return False
    if not flag:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    return True


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    return linux_libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
