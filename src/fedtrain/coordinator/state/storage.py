"""Storage failures: a full disk (or quota) under the state directory, told apart from bugs.

A full disk is an operator's problem with an operator's fix (free space), not an internal
error: the API answers 507 with what to do, event writes never raise for it, and a commit
that failed for it goes back and commits again once there is room (`rounds/progress.py`).
"""

from __future__ import annotations

import errno
import sqlite3

#: The errnos of "no room": the device or the user's quota is full.
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
RETRY_AFTER_S = 10
MESSAGE = ("the coordinator's disk is full: it cannot store its state; free space in the file system of its state "
           "directory, then retry (the run goes on by itself once there is room)")


def storage_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the disk or the database could not grow."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc).lower():
            return True  # SQLITE_FULL: "database or disk is full"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False
