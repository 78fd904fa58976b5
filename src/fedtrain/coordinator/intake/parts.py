"""Resumable uploads: an update (or a piece of one) that travels as parts.

An upload session holds one body on its way in: the exact bytes a whole upload would send
(`total` of them, digest `digest`), cut in parts of `part_bytes` (the last one shorter):
part i is bytes [i * part_bytes, min(total, (i + 1) * part_bytes)). Parts are transport,
not meaning (a piece, `pieces.py`, is about rows): each is checked against its own digest
as it streams, written at its offset into the session's spool file, and counted as held
only once verified. The ordinary upload flow (`Uploads.receive_update`: the whole digest,
the header and the values checked, then placed as a whole upload is) reads the body as its
parts arrive (`consume`): `held_body` yields the contiguous prefix of held parts and waits
for more, never reading past it, so when the last part lands only its tail is left to read,
check and place. The update still counts only once the whole is in and its digest holds.
The consumer gives up (its body raises `Abandoned`) when its session is dropped; the file
goes once no part streams into it (a consumer reading the tail of a complete body keeps it
until it has ended). At most `MAX_READERS_PER_PID` of a participant's sessions have a
consumer at once; one without is read whole once complete. The bytes on disk are
`part_files.py`'s.

What a session may hold is bounded: its participant's sessions together hold at most
`max_upload_mb` (the bound of one whole upload), and at most `MAX_SESSIONS_PER_PID` of
them. A session goes when its update is in, when a part names another body for the same
(participant, round, piece) (the newer wins), when its round can take no late update any
more (at the round's close past the staleness bound, else at the next part anyone sends),
when its participant leaves, rejoins or is evicted, or when it has heard no part for `IDLE_S`.

Event loop only, but for the writes, which run on worker threads.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fedtrain.coordinator.intake.part_files import file_chunks, held_body, size_file, write_part
from fedtrain.coordinator.intake.spool import SpoolFiles
from fedtrain.errors import Refused
from fedtrain.transport.body import Body
from fedtrain.transport.progress import Progress
from fedtrain.wire.digest import digests_equal, parse_digest

#: The smallest part a session may use (but for its last) and the largest.
MIN_PART_BYTES = 64 << 10
MAX_PART_BYTES = 1 << 30
#: The most parts one body may come in (a 14 GB update in 1 MiB parts is 13,351).
MAX_PARTS = 1 << 16
#: The sessions one participant may hold at once (an update, or its pieces, per round).
MAX_SESSIONS_PER_PID = 64
#: The parts of one participant streaming in at once, all its sessions together (what
#: `transfer.streams` may ask for; each holds two receive buffers of up to `part_files.BATCH`).
MAX_STREAMING_PER_PID = 16
#: The readers of one participant's sessions running at once (`consume`): each may hold two
#: read buffers of `part_files.BATCH` and the flow's two receive buffers while it waits for
#: parts; a session without one is read whole once complete, as before there were readers.
MAX_READERS_PER_PID = 4
#: How long a part over that bound waits for one of its participant's parts to end before it
#: is refused (a client starts its next part once the last one's bytes are written, while
#: the coordinator may still be reading their tail), and how many such parts may wait.
SLOT_WAIT_S = 2.0
MAX_WAITING_PER_PID = MAX_STREAMING_PER_PID
#: A session that has heard no part for this long (and has none streaming) is reclaimed.
IDLE_S = 600.0

Key = tuple[str, int, str | None]  # (participant, round, piece label or None: the whole update)


@dataclass(frozen=True)
class PartClaim:
    """What a part says of the body it belongs to (every part says the same) and of itself."""

    index: int
    total: int  # bytes of the whole body
    part_bytes: int  # bytes of each part but the last
    digest: str  # the whole body's digest
    tokens: int

    @property
    def count(self) -> int:
        return math.ceil(self.total / self.part_bytes)

    def span(self, index: int) -> tuple[int, int]:
        """Part `index`'s bytes: [start, stop) of the whole body."""
        start = index * self.part_bytes
        return start, min(self.total, start + self.part_bytes)

    def same_body(self, other: PartClaim) -> bool:
        return (self.total, self.part_bytes, self.tokens) == (other.total, other.part_bytes, other.tokens) and \
            digests_equal(self.digest, other.digest)


def check_claim(claim: PartClaim, length: int | None, limit: int) -> None:
    """Refuse (4xx) a part whose claims do not hold together, before a byte of it is read."""
    parse_digest(claim.digest)
    if claim.total > limit:
        raise Refused(413, "too_large", f"an upload of {claim.total:,} bytes exceeds max_upload_mb ({limit:,} bytes)")
    if claim.total <= claim.part_bytes:
        raise Refused(400, "part_not_needed", f"a body of {claim.total:,} bytes fits in one part of "
                      f"{claim.part_bytes:,}: upload it whole")
    if claim.count > MAX_PARTS:
        raise Refused(400, "too_many_parts", f"{claim.total:,} bytes in parts of {claim.part_bytes:,} is "
                      f"{claim.count:,} parts, more than one body may come in ({MAX_PARTS:,}): use larger parts")
    if claim.index >= claim.count:
        raise Refused(400, "part_out_of_range", f"part {claim.index} of a body of {claim.total:,} bytes in parts "
                      f"of {claim.part_bytes:,}: there are {claim.count} parts, numbered from 0")
    start, stop = claim.span(claim.index)
    if length is None:
        raise Refused(411, "length_required", "parts need a Content-Length header")
    if length != stop - start:
        raise Refused(400, "part_length", f"part {claim.index} is bytes [{start:,}, {stop:,}) of the body: "
                      f"{stop - start:,} bytes, not {length:,}")


@dataclass
class Session:
    """One body coming in as parts, into the spool file `path` (`new`: made for it)."""

    key: Key
    claim: PartClaim
    path: Path
    new: bool
    heard: float  # the monotonic time of its last part (begun or ended)
    held: dict[int, str] = field(default_factory=dict)  # verified parts: index -> digest
    streaming: set[int] = field(default_factory=set)  # parts being received now
    assembling: bool = False  # every part is in: the whole is being checked and placed
    gone: bool = False  # dropped: a part still streaming into it is refused at its end
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no part streams and no consumer runs
    progress: Progress | None = None  # the bytes received of it (parts sent again count again)
    prefix: int = 0  # parts [0, prefix) are held: the bytes a consumer may read
    consumer: asyncio.Task[dict[str, Any]] | None = None  # the upload flow reading it (`consume`)
    feed: Body | None = None  # what that consumer reads (`held_body`): abandoned when the session goes
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each part held, or the drop
    released: bool = False  # dropped, and its file given back

    @property
    def complete(self) -> bool:
        return len(self.held) == self.claim.count

    @property
    def total(self) -> int:
        return self.claim.total

    @property
    def consuming(self) -> bool:
        return self.consumer is not None and not self.consumer.done()

    def prefix_bytes(self) -> int:
        """Bytes [0, this) of the body are held: parts 0 to `prefix` - 1."""
        return self.claim.span(self.prefix - 1)[1] if self.prefix else 0

    def held_bytes(self) -> int:
        return sum(stop - start for start, stop in (self.claim.span(i) for i in self.held))

    def hold(self, index: int, digest: str) -> None:
        """Part `index` is verified: held, and a consumer waiting for it is woken."""
        self.held[index] = digest
        while self.prefix in self.held:
            self.prefix += 1
        self.wake()

    def wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def view(self) -> dict[str, Any]:
        """As the session's GET answers it: which parts are held, which are missing."""
        c = self.claim
        missing = [i for i in range(c.count) if i not in self.held]
        return {"digest": c.digest, "total": c.total, "part_bytes": c.part_bytes, "parts": c.count,
                "held": sorted(self.held), "missing": missing, "held_bytes": self.held_bytes(),
                "streaming": sorted(self.streaming),
                "complete": self.complete, "assembling": self.assembling}


class PartSessions:
    """The upload sessions in progress, by (participant, round, piece). Their files are the
    spool's (`SpoolFiles`); `clock` is monotonic (tests pass their own)."""

    def __init__(self, files: SpoolFiles, clock: Callable[[], float] = time.monotonic) -> None:
        self._files = files
        self._clock = clock
        self._sessions: dict[Key, Session] = {}
        self._part_ended = asyncio.Event()  # set (and replaced) whenever a part stops streaming
        self._waiting: dict[str, int] = {}  # participant -> its parts waiting for a streaming slot

    def get(self, key: Key) -> Session | None:
        return self._sessions.get(key)

    def of(self, pid: str) -> list[Session]:
        return [s for k, s in self._sessions.items() if k[0] == pid]

    @property
    def count(self) -> int:
        return len(self._sessions)

    def held_bytes(self) -> int:
        """Bytes the sessions hold on disk now (their files' sizes)."""
        return sum(s.claim.total for s in self._sessions.values())

    async def open(self, key: Key, claim: PartClaim, limit: int, stop_parts: Callable[[], None],
                   wait_s: float) -> Session:
        """The session `claim` belongs to: the one in progress for `key` when it is for the
        same body, else a new one (an older session for another body is dropped: the newer
        wins, its parts still streaming stopped with `stop_parts()` and waited for, at most
        `wait_s`). Refuses (413, 429) what would hold more than its participant may."""
        self.reclaim_idle()
        old = self._sessions.get(key)
        if old is not None and old.claim.same_body(claim):
            return old
        if old is not None:
            if old.assembling:
                raise Refused(409, "upload_assembling", f"the update of {key[0]} for round {key[1]} is complete and "
                              "being placed; ask the round's status before sending another")
            stop_parts()
            self.drop(old)
            if not old.idle.is_set() and not await _wait(old.idle, wait_s):
                raise Refused(429, "upload_in_progress", f"parts of an earlier upload of {key[0]} for round {key[1]} "
                              "are still streaming; send again once they are over", {"retry_after_s": 1.0})
            if key in self._sessions:  # another new body came meanwhile: the newest wins, again
                return await self.open(key, claim, limit, stop_parts, wait_s)
        mine = self.of(key[0])
        if len(mine) >= MAX_SESSIONS_PER_PID:
            raise Refused(429, "too_many_sessions", f"{key[0]} has {len(mine)} uploads in parts in progress, the most "
                          f"one participant may ({MAX_SESSIONS_PER_PID})")
        held = sum(s.claim.total for s in mine)
        if held + claim.total > limit:
            raise Refused(413, "too_large", f"{key[0]}'s uploads in parts would hold {held + claim.total:,} bytes, "
                          f"more than max_upload_mb allows ({limit:,} bytes)")
        path, new = self._files.take()
        session = Session(key, claim, path, new, self._clock(),
                          progress=Progress(f"upload of round {key[1]} in parts", claim.total))
        session.idle.set()
        # In before the first await: the other parts of the body, arriving side by side, find
        # it (and write into it: every write is below `total`, so sizing the file may come in
        # any order with them).
        self._sessions[key] = session
        try:
            await asyncio.to_thread(size_file, path, claim.total)
        except BaseException:
            self.drop(session)
            raise
        return session

    async def receive(self, session: Session, index: int, digest: str, body: Body) -> bool:
        """Receive part `index` of `session` (its length checked already, `check_claim`) into its
        place in the file, checked against `digest` as it streams. True when it is held now;
        False when it was held already (its body is not read). Raises Refused (400
        part_digest_mismatch: send it again) or the body's error."""
        parse_digest(digest)
        try:
            await self._slot(session, index)
        except BaseException:
            await body.drain()
            raise
        if index in session.held or session.assembling:
            await body.drain()
            return False
        session.streaming.add(index)
        session.idle.clear()
        if session.progress is not None:
            body.count_with(session.progress.add)
        session.heard = self._clock()
        try:
            start, stop = session.claim.span(index)
            got = await write_part(body, session.path, start, stop - start, digest)
            if session.gone:
                raise Refused(409, "upload_replaced", f"the upload part {index} belonged to was replaced or "
                              "dropped while it streamed in")
            if not digests_equal(got, digest):
                raise Refused(400, "part_digest_mismatch", f"part {index}'s bytes have digest {got}, not the "
                              f"{digest} it was sent with: send it again")
            session.hold(index, digest)
            return True
        except BaseException:
            await body.drain()
            raise
        finally:
            session.streaming.discard(index)
            session.heard = self._clock()
            ended, self._part_ended = self._part_ended, asyncio.Event()
            ended.set()
            self._release_if_unused(session)

    async def _slot(self, session: Session, index: int) -> None:
        """Wait (at most SLOT_WAIT_S) until part `index` may stream in: fewer than
        MAX_STREAMING_PER_PID parts of its participant are streaming (a client starts its next
        part once the last one's bytes are written, and those may still be on their way here).
        Refuses (429) past the wait, or when too many of its parts wait already."""
        pid = session.key[0]
        if index in session.streaming:  # (the route lets one attempt per part in at a time)
            raise Refused(429, "upload_in_progress", f"part {index} is streaming in on another connection",
                          {"retry_after_s": 1.0})
        streaming = self._streaming(pid)
        if streaming < MAX_STREAMING_PER_PID or index in session.held or session.assembling:
            return
        waiting = self._waiting.get(pid, 0)
        if waiting < MAX_WAITING_PER_PID:
            self._waiting[pid] = waiting + 1
            loop = asyncio.get_running_loop()
            deadline = loop.time() + SLOT_WAIT_S
            try:
                while (streaming := self._streaming(pid)) >= MAX_STREAMING_PER_PID and \
                        await _wait(self._part_ended, deadline - loop.time()):
                    pass
            finally:
                self._waiting[pid] -= 1
                if not self._waiting[pid]:
                    del self._waiting[pid]
            if index in session.streaming:
                raise Refused(429, "upload_in_progress", f"part {index} is streaming in on another connection",
                              {"retry_after_s": 1.0})
            if streaming < MAX_STREAMING_PER_PID:
                return
        raise Refused(429, "too_many_parts_in_flight", f"{pid} has {streaming} parts streaming in, the "
                      f"most one participant may send at once ({MAX_STREAMING_PER_PID})", {"retry_after_s": 1.0})

    def _streaming(self, pid: str) -> int:
        return sum(len(s.streaming) for s in self.of(pid))

    def consume(self, session: Session, run: Callable[[Body], Awaitable[dict[str, Any]]]) -> None:
        """Start `run` (the upload flow) on `session`'s body as its parts arrive (`held_body`),
        unless one runs already (or the session is complete and placed by the part that
        completed it). Its answer, or its error, is `session.consumer`'s; it gives up when the
        session is dropped."""
        if session.consuming or session.gone or session.assembling:
            return
        if sum(s.consuming for s in self.of(session.key[0])) >= MAX_READERS_PER_PID:
            return  # (read whole once complete; another part may start it once a reader is free)
        feed = Body(cast(AsyncIterator[bytes], held_body(session)))  # (a Body takes views as it takes bytes)
        session.feed = feed
        session.idle.clear()
        task = asyncio.ensure_future(run(feed))
        session.consumer = task

        def ended(t: asyncio.Task[dict[str, Any]]) -> None:
            if not t.cancelled():
                t.exception()  # (retrieved: whoever needs the outcome reads it from the task)
            if session.feed is feed:
                session.feed = None
            self._release_if_unused(session)

        task.add_done_callback(ended)

    def _release_if_unused(self, session: Session) -> None:
        """Once no part streams into `session` and no consumer reads it, it is idle. A dropped
        session's file goes once no part streams into it: a consumer still waiting reads no
        byte of it after the drop (`held_body`), but one reading the tail of a complete body
        keeps it until it has ended."""
        if not session.streaming and not session.consuming:
            session.idle.set()
        if session.gone and not session.released and not session.streaming and \
                not (session.assembling and session.consuming):
            session.released = True
            self._files.discard(session.path, session.new)

    def whole(self, session: Session) -> Body:
        """The complete session's file as the body of an ordinary upload."""
        return Body(file_chunks(session.path, session.claim.total))

    def drop(self, session: Session) -> None:
        """Forget `session`: its consumer gives up; its file goes now, or once no part streams
        into it and its consumer has ended."""
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
        if session.gone:
            return
        session.gone = True
        session.wake()
        ended, self._part_ended = self._part_ended, asyncio.Event()  # its parts count no more
        ended.set()
        if session.feed is not None and not session.assembling:
            session.feed.abandon()
        self._release_if_unused(session)

    def drop_where(self, keep: Callable[[Key], bool]) -> int:
        """Drop every session whose key `keep` refuses; how many went."""
        gone = [s for k, s in self._sessions.items() if not keep(k) and not s.assembling]
        for s in gone:
            self.drop(s)
        return len(gone)

    async def stop(self) -> None:
        """Shutting down: every session goes, and its consumer with it (cancelled, then awaited)."""
        sessions = list(self._sessions.values())
        for session in sessions:
            self.drop(session)
        consumers = [s.consumer for s in sessions if s.consumer is not None and not s.consumer.done()]
        for task in consumers:
            task.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)

    def reclaim_idle(self) -> int:
        """Drop the sessions that heard no part for IDLE_S (none streaming)."""
        now = self._clock()
        return self.drop_where(lambda k: self._sessions[k].streaming != set() or now - self._sessions[k].heard < IDLE_S)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True
