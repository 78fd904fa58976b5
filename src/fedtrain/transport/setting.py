"""The one setting that switches every fast IO path on or off: `FEDTRAIN_FAST_IO`.

On by default. Off (`0`, `off`, `false` or `no`, in any case) means the plain paths
throughout: uvicorn's stock HTTP protocol (no `READINTO`/`SEND` extensions, so uploads
come as `receive()` chunks and downloads as a chunked StreamingResponse), checkpoints
written through the page cache (no O_DIRECT), no allocator tuning, no direct receive into
the running sum and no patch of httpcore. Code that starts a coordinator passes an
explicit `fast_io` (True/False) to override the environment; None leaves it to the
environment. The setting is read when a server, a checkpoint directory or a client is
built, not per request.
"""

from __future__ import annotations

import os

FAST_IO_ENV = "FEDTRAIN_FAST_IO"
OFF = frozenset({"0", "off", "false", "no"})


def fast_io_enabled(override: bool | None = None) -> bool:
    """Whether the fast IO paths are on: `override` when given, else `FEDTRAIN_FAST_IO`
    (on unless it says 0, off, false or no)."""
    if override is not None:
        return override
    return os.environ.get(FAST_IO_ENV, "").strip().lower() not in OFF
