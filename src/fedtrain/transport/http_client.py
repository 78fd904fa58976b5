"""The one process-wide tweak of the HTTP stack under httpx: how much httpcore reads at a time.

httpcore reads a response 64 KiB at a time and runs its HTTP/1.1 parser once per read, so a
large model download spends much of its time in the parser. The read size is a class
attribute of httpcore's connection (`HTTP11Connection.READ_NUM_BYTES`), so raising it holds
for every client of the process. A read returns what the socket has and never waits to fill
the larger buffer, so small answers are not delayed.

`tune_httpcore` is called by every `CoordinatorClient` when it is created. The plain path is
httpcore's own value, which `tune_httpcore(False)` puts back, so one process can run with the
fast path on, then off. It is on unless `FEDTRAIN_FAST_IO` is 0, off, false or no. The
httpcore versions whose internals this touches are pinned in `pyproject.toml`; a httpcore
without that attribute is left as it is.
"""

from __future__ import annotations

import threading

from fedtrain.transport.setting import fast_io_enabled

__all__ = ["READ_BYTES", "tune_httpcore"]

#: The read size when tuned: large enough that the parser runs rarely per megabyte.
READ_BYTES = 1 << 20

_lock = threading.Lock()
_original: int | None = None  # httpcore's own read size, noted before the first change


def tune_httpcore(enabled: bool | None = None) -> bool:
    """Raise httpcore's read size to `READ_BYTES` (`enabled`), or put its own value back.

    `enabled` None: as `FEDTRAIN_FAST_IO` says. Returns whether the larger reads are in force."""
    global _original
    if enabled is None:
        enabled = fast_io_enabled()
    try:
        from httpcore._sync.http11 import HTTP11Connection
    except ImportError:  # a httpcore without that module: keep its default
        return False
    with _lock:  # clients are created on several threads (heartbeats, event stream)
        current = getattr(HTTP11Connection, "READ_NUM_BYTES", None)
        if not isinstance(current, int):  # a httpcore that reads otherwise: leave it alone
            return False
        if _original is None:
            _original = current
        wanted = max(_original, READ_BYTES) if enabled else _original
        if current != wanted:
            HTTP11Connection.READ_NUM_BYTES = wanted
    return enabled
