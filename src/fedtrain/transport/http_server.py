"""Which HTTP protocol uvicorn serves the coordinator with: the fast one (`ReadIntoProtocol`,
held to `ServerLimits`) when fast IO is on and the installed uvicorn and httptools are in
their tested range (`versions.py`); else uvicorn's stock httptools protocol, the plain path."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fedtrain.transport import versions
from fedtrain.transport.server_limits import ServerLimits
from fedtrain.transport.setting import fast_io_enabled

STOCK = "httptools"
"""uvicorn's name for its stock httptools protocol."""


def fast_protocol(limits: ServerLimits, fast_io: bool | None = None) -> Callable[..., Any] | None:
    """A factory of the fast protocol held to `limits`, for `uvicorn.Config(http=...)`; None
    when the plain path serves: fast IO off (`fast_io`, else `FEDTRAIN_FAST_IO`), or uvicorn or
    httptools outside their tested range (then with a warning, once)."""
    if not fast_io_enabled(fast_io) or versions.outside_tested("uvicorn", "httptools"):
        return None
    from fedtrain.transport.readinto import ReadIntoProtocol

    # A BufferedProtocol, which uvicorn only constructs: with our limits.
    return functools.partial(ReadIntoProtocol, limits=limits)
