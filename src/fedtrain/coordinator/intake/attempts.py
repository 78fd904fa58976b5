"""The attempts of uploads in progress, one per key: (participant, round, piece) for a whole
upload, (participant, round, piece, part) for one part of an upload in parts.

A newer attempt for a key takes over from the one in progress: the older is stopped (its
connection closed: a client only sends again when it has given that connection up, e.g.
silent past its `transfer.stall_timeout_s`), and the newer goes on once the older has ended
(its files given back, its slot free), so a dead connection never blocks its own retry.
Only the participant itself may upload as itself, so a takeover stops nothing of anyone
else's. Event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

#: The longest a newer attempt waits for the older it stopped to end (an older one busy
#: folding a body it received whole is not stopped by its connection's close).
TAKEOVER_WAIT_S = 10.0


@dataclass(eq=False)
class Attempt:
    """One request uploading under a key; `stop()` ends it (closes its connection)."""

    stop_fn: Callable[[], None]
    stopped: bool = False  # a newer attempt took over
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.stop_fn()


class Attempts:
    """The upload attempts in progress, at most one per key."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, Attempt] = {}

    async def begin(self, key: Hashable, stop: Callable[[], None], wait_s: float = TAKEOVER_WAIT_S) -> Attempt | None:
        """The attempt of a request now starting under `key`, once any older one is stopped
        and has ended; None when the older did not end within `wait_s` (answer 429)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (old := self._by_key.get(key)) is not None:
            old.stop()
            try:
                await asyncio.wait_for(old.ended.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return None
        attempt = Attempt(stop)
        self._by_key[key] = attempt
        return attempt

    def end(self, key: Hashable, attempt: Attempt) -> None:
        """`attempt`'s request is over (whatever became of it)."""
        if self._by_key.get(key) is attempt:
            del self._by_key[key]
        attempt.ended.set()

    def holds(self, key: Hashable) -> bool:
        return key in self._by_key

    def stop_where(self, match: Callable[[Hashable], bool]) -> int:
        """Stop every attempt whose key `match`es (e.g. the parts of a body replaced by a newer one)."""
        found = [a for k, a in self._by_key.items() if match(k)]
        for a in found:
            a.stop()
        return len(found)

    @property
    def count(self) -> int:
        return len(self._by_key)
