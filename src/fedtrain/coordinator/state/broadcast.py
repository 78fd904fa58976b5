"""Fan-out of run events to server-sent-event subscribers (participants and dashboards).

More: docs/architecture.md, "coordinator/state/broadcast.py".
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

STATUS = "status"
KEEPALIVE = ": keep-alive\n\n"
#: A subscriber's queue at most, in events and in bytes of their text: one that falls this far
#: behind is dropped (it reconnects, and its `hello` brings it up to date).
MAX_QUEUED = 1000
MAX_QUEUED_BYTES = 4 << 20
#: What one send of a stream takes off its queue at most (an event larger than it goes alone).
BATCH_BYTES = 64 << 10


class Subscription:
    """One subscriber's stream: the texts of its events in order, and a mark where the status is due."""

    def __init__(self, owner: Broadcaster, maxsize: int, maxbytes: int) -> None:
        self._owner = owner
        self._maxsize, self._maxbytes = maxsize, maxbytes
        self._queue: deque[str | None] = deque()  # None: the status as of then
        self._bytes = 0  # the length of the texts queued (a status, shared by all, counts none)
        self._status_due = False  # a None is in the queue
        self._ready = asyncio.Event()
        self.closed = False

    def put(self, text: str) -> bool:
        """Queue an event; False when the queue is full, in events or bytes (the publisher then
        drops this subscriber)."""
        if len(self._queue) >= self._maxsize or self._bytes + len(text) > self._maxbytes:
            return False
        self._queue.append(text)
        self._bytes += len(text)
        self._ready.set()
        return True

    def status_changed(self) -> bool:
        """Mark the status due, once until it is read; False when the queue is full."""
        if self._status_due:
            return True
        if len(self._queue) >= self._maxsize:
            return False
        self._status_due = True
        self._queue.append(None)
        self._ready.set()
        return True

    @property
    def pending(self) -> int:
        """Events queued and not yet read (a due status counts as one)."""
        return len(self._queue)

    @property
    def pending_bytes(self) -> int:
        """The length of the event texts queued and not yet read (a due status not counted)."""
        return self._bytes

    def close(self) -> None:
        """End the stream (at its next read) and leave the broadcaster."""
        self.closed = True
        self._queue.clear()
        self._bytes = 0
        self._ready.set()
        self._owner.unsubscribe(self)

    async def events(self, keepalive_s: float, status: Callable[[], Any]) -> AsyncIterator[str]:
        """The texts to send, as they come, each time what is queued in one piece of at most
        BATCH_BYTES (or one larger event alone), so that a send holds no copy of a long queue;
        `KEEPALIVE` after `keepalive_s` without any; the status built by `status()` (once per
        change, for every subscriber). Ends once closed."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            if not self._queue:
                self._ready.clear()
                timer = loop.call_later(keepalive_s, self._ready.set)
                try:
                    await self._ready.wait()
                finally:
                    timer.cancel()
                if not self._queue and not self.closed:
                    yield KEEPALIVE
                continue
            texts: list[str] = []
            size = 0
            while self._queue and (not texts or size + len(self._queue[0] or "") <= BATCH_BYTES):
                text = self._queue.popleft()
                if text is None:
                    self._status_due = False
                    text = self._owner.status_text(status)
                else:
                    self._bytes -= len(text)
                texts.append(text)
                size += len(text)
            yield "".join(texts)


class Broadcaster:
    """The run's SSE subscribers, and the status snapshot they share."""

    def __init__(self, maxsize: int = MAX_QUEUED, maxbytes: int = MAX_QUEUED_BYTES) -> None:
        self.maxsize, self.maxbytes = maxsize, maxbytes
        self._subscribers: set[Subscription] = set()
        self._changes = 0  # status changes published so far
        self._snapshot: tuple[int, str] | None = None  # (changes when built, its event text)

    def subscribe(self) -> Subscription:
        subscription = Subscription(self, self.maxsize, self.maxbytes)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def publish(self, kind: str, data: Any) -> None:
        """Send an event to every subscriber (`kind` "status": the status changed; `data` unused)."""
        if kind == STATUS:
            self._changes += 1
            for subscription in list(self._subscribers):
                if not subscription.status_changed():
                    subscription.close()  # too slow to keep up: it reconnects
            return
        text = sse(kind, data)
        for subscription in list(self._subscribers):
            if not subscription.put(text):
                subscription.close()

    def status_text(self, build: Callable[[], Any]) -> str:
        """The status event as of the last change: built by `build()` the first time it is
        asked for after a change, the same text for every subscriber until the next."""
        if self._snapshot is None or self._snapshot[0] != self._changes:
            self._snapshot = (self._changes, sse(STATUS, build()))
        return self._snapshot[1]

    def close_all(self) -> None:
        for subscription in list(self._subscribers):
            subscription.close()

    @property
    def count(self) -> int:
        return len(self._subscribers)


def sse(kind: str, data: Any) -> str:
    """One server-sent event."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
