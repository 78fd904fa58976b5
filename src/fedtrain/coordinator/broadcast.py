"""Fan-out of run events to server-sent-event subscribers (participants and dashboards).

Each subscriber has a bounded queue; a subscriber too slow to keep up is dropped (its
stream ends and it reconnects) rather than letting the coordinator's memory grow.
Publishing never blocks and happens on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

CLOSED = ("__closed__", None)


class Broadcaster:
    def __init__(self, maxsize: int = 1000) -> None:
        self.maxsize = maxsize
        self._subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(self.maxsize)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        self._subscribers.discard(q)

    def publish(self, kind: str, data: Any) -> None:
        for q in list(self._subscribers):
            try:
                q.put_nowait((kind, data))
            except asyncio.QueueFull:
                self._subscribers.discard(q)
                q.get_nowait()  # make room for the end-of-stream marker
                q.put_nowait(CLOSED)

    def close_all(self) -> None:
        for q in list(self._subscribers):
            self.publish("__closed__", None)
            self._subscribers.discard(q)

    @property
    def count(self) -> int:
        return len(self._subscribers)


def sse(kind: str, data: Any) -> str:
    """One server-sent event."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
