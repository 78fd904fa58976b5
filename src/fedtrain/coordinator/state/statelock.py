"""The state directory's owner: one coordinator process at a time, held by an OS lock.

More: docs/architecture.md, "coordinator/state/statelock.py".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from fedtrain.errors import StateError

LOCK_FILE = "coordinator.lock"


class StateLock:
    """An exclusive, process-lifetime lock on a state directory."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        """Lock `state_dir` (created if missing) or raise StateError naming the coordinator holding it."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise StateError(
                f"{state_dir} is in use by another coordinator ({holder}); a state directory belongs to one "
                "coordinator at a time: stop that one first, or use another --state-dir"
            ) from None
        except OSError as e:
            os.close(fd)
            raise StateError(f"cannot lock {path}: {e.strerror}") from None
        lock = cls(state_dir, fd)
        lock.record(url=None)
        return lock

    def record(self, url: str | None) -> None:
        """Write who holds the lock (pid, and the URL once known) for a refused start to show."""
        if self._fd is None:
            return
        data = json.dumps({"pid": os.getpid(), "url": url}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        data = json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    pid, url = holder.get("pid"), holder.get("url")
    parts = [f"pid {pid}" if isinstance(pid, int) else "pid unknown"]
    if isinstance(url, str) and url:
        parts.append(f"serving {url}")
    return ", ".join(parts)
