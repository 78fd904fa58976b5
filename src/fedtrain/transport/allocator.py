"""The fast path's process tuning: glibc's allocator told to give large freed blocks back.

glibc keeps freed large blocks in per-thread arenas and raises its mmap threshold after
each free, so tensors read on the worker threads of concurrent uploads ratchet the
coordinator's RSS up with the number of participants. A fixed threshold keeps the peak
flat. `fedtrain coordinator` calls `tune_process()` once at start; with fast IO off it
leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes

from fedtrain.transport.setting import fast_io_enabled

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def tune_allocator(threshold: int = 1 << 20, trim: int = 16 << 20) -> bool:
    """Send every freed block of `threshold` bytes or more straight back to the OS, and keep
    up to `trim` bytes of free memory at the top of the heap; whether glibc took both.

    Fixing the mmap threshold also fixes the trim threshold, at 128 KiB: the heap was then
    shrunk and grown again all through an upload, whose ~160 KiB body chunks are held a few
    MiB at a time until the spool writer is done with them, and every regrown page was
    faulted in and zeroed again; `trim` keeps that memory. No effect outside glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))
    except (OSError, AttributeError):
        return False


def tune_process(fast_io: bool | None = None) -> bool:
    """`tune_allocator()` when fast IO is on (`fast_io`, else `FEDTRAIN_FAST_IO`); whether it was tuned."""
    return fast_io_enabled(fast_io) and tune_allocator()
