"""Upload sessions in parts (`coordinator/intake/parts.py`), with an injected clock: a session
left idle is reclaimed with its file, a newer body replaces an older one, the parts of a
complete session are the body, bit for bit, and a consumer reads that body as its parts
arrive, never past the parts held, giving up when its session is dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fedtrain.coordinator.intake import parts
from fedtrain.coordinator.intake.parts import PartClaim, PartSessions
from fedtrain.coordinator.intake.spool import SpoolFiles
from fedtrain.errors import Refused
from fedtrain.transport import Abandoned, Body
from fedtrain.wire import digest_bytes

PART = parts.MIN_PART_BYTES
DATA = bytes(range(256)) * (PART * 3 // 256 + 7)  # three parts and a short fourth


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def chunks(data: bytes):  # type: ignore[no-untyped-def]
    for i in range(0, len(data), 10_000):
        yield data[i : i + 10_000]


def claim(index: int, data: bytes = DATA) -> PartClaim:
    return PartClaim(index, len(data), PART, digest_bytes(data), 100)


def part(index: int, data: bytes = DATA) -> bytes:
    start, stop = claim(index, data).span(index)
    return data[start:stop]


def files(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.iterdir() if p.stat().st_size]


def test_parts_make_the_body_bit_for_bit_and_an_idle_session_is_reclaimed(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path), clock)
        key = ("p0", 0, None)
        s = await sessions.open(key, claim(0), 1 << 30, lambda: None, 1.0)
        for i in reversed(range(claim(0).count)):  # any order
            assert await sessions.receive(s, i, digest_bytes(part(i)), Body(chunks(part(i))))
        assert s.complete
        assert await sessions.whole(s).read(len(DATA) + 1) == DATA
        assert not await sessions.receive(s, 1, digest_bytes(part(1)), Body(chunks(part(1))))  # held: not read
        # another participant's session, left after one part
        other = await sessions.open(("p1", 0, None), claim(0), 1 << 30, lambda: None, 1.0)
        await sessions.receive(other, 0, digest_bytes(part(0)), Body(chunks(part(0))))
        sessions.drop(s)
        assert sessions.count == 1 and len(files(tmp_path)) == 1
        clock.now += parts.IDLE_S - 1
        assert sessions.reclaim_idle() == 0
        clock.now += 2
        assert sessions.reclaim_idle() == 1
        assert sessions.count == 0 and files(tmp_path) == []

    asyncio.run(go())


def test_a_part_with_a_wrong_digest_is_not_held_and_a_newer_body_replaces_an_older(tmp_path: Path) -> None:
    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path))
        key = ("p0", 0, None)
        s = await sessions.open(key, claim(0), 1 << 30, lambda: None, 1.0)
        with pytest.raises(Refused) as e:
            await sessions.receive(s, 2, digest_bytes(b"other"), Body(chunks(part(2))))
        assert e.value.code == "part_digest_mismatch" and s.held == {}
        await sessions.receive(s, 2, digest_bytes(part(2)), Body(chunks(part(2))))
        newer = DATA[::-1]
        stopped = []
        s2 = await sessions.open(key, claim(0, newer), 1 << 30, lambda: stopped.append(1), 1.0)
        assert s2 is not s and s.gone and stopped == [1] and s2.held == {}
        assert sessions.count == 1 and len(files(tmp_path)) == 1
        with pytest.raises(Refused) as e:  # more than the participant may hold, all its sessions together
            await sessions.open(("p0", 0, "b"), claim(0), len(DATA) + len(DATA) // 2, lambda: None, 1.0)
        assert e.value.status == 413

    asyncio.run(go())


def test_parts_arriving_side_by_side_make_one_session(tmp_path: Path) -> None:
    """The parts of a body sent at once (transfer.streams) all land in one session, whichever opens it."""
    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path))
        key = ("p0", 0, None)

        async def one(i: int) -> bool:
            s = await sessions.open(key, claim(i), 1 << 30, lambda: None, 1.0)
            return await sessions.receive(s, i, digest_bytes(part(i)), Body(chunks(part(i))))

        assert await asyncio.gather(*(one(i) for i in range(claim(0).count))) == [True] * claim(0).count
        s = sessions.get(key)
        assert s is not None and s.complete and sessions.count == 1
        assert await sessions.whole(s).read(len(DATA) + 1) == DATA

    asyncio.run(go())


class Reader:
    """A consumer of a session's body (`PartSessions.consume`): what it has read so far."""

    def __init__(self) -> None:
        self.got = bytearray()
        self.grew = asyncio.Event()

    async def __call__(self, body: Body) -> dict[str, int]:
        buf = memoryview(bytearray(4096))  # (parts are whole multiples of it: a read never spans a wait)
        while True:
            n = await body.readinto(buf)
            self.got += buf[:n]
            self.grew.set()
            if n < len(buf):
                return {"bytes": len(self.got)}

    async def has(self, nbytes: int) -> None:
        while len(self.got) < nbytes:
            self.grew.clear()
            await asyncio.wait_for(self.grew.wait(), 10)


def test_a_consumer_reads_the_parts_held_from_the_first_as_they_come_and_never_past_them(tmp_path: Path) -> None:
    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path))
        s = await sessions.open(("p0", 0, None), claim(0), 1 << 30, lambda: None, 1.0)
        reader = Reader()
        sessions.consume(s, reader)
        await sessions.receive(s, 2, digest_bytes(part(2)), Body(chunks(part(2))))  # out of order: a gap before it
        await sessions.receive(s, 0, digest_bytes(part(0)), Body(chunks(part(0))))
        await reader.has(PART)
        await asyncio.sleep(0.1)
        assert bytes(reader.got) == DATA[:PART]  # part 2 is held, part 1 is not: it waits at the gap
        await sessions.receive(s, 1, digest_bytes(part(1)), Body(chunks(part(1))))
        await reader.has(3 * PART)
        assert not s.consumer.done()  # type: ignore[union-attr]
        await sessions.receive(s, 3, digest_bytes(part(3)), Body(chunks(part(3))))
        assert await asyncio.wait_for(s.consumer, 10) == {"bytes": len(DATA)}  # type: ignore[arg-type]
        assert bytes(reader.got) == DATA
        sessions.drop(s)
        assert files(tmp_path) == []

    asyncio.run(go())


def test_a_dropped_session_stops_its_waiting_consumer_and_its_file_goes_at_once(tmp_path: Path) -> None:
    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path))
        s = await sessions.open(("p0", 0, None), claim(0), 1 << 30, lambda: None, 1.0)
        reader = Reader()
        sessions.consume(s, reader)
        await sessions.receive(s, 0, digest_bytes(part(0)), Body(chunks(part(0))))
        await reader.has(PART)
        assert not s.idle.is_set()  # its consumer runs: a newer body waits for it to end
        sessions.drop(s)
        assert files(tmp_path) == []  # (the consumer reads no byte of it from now on)
        with pytest.raises(Abandoned):
            await asyncio.wait_for(s.consumer, 10)  # type: ignore[arg-type]
        await asyncio.wait_for(s.idle.wait(), 10)
        assert bytes(reader.got) == DATA[:PART]

    asyncio.run(go())


def test_a_participant_has_at_most_so_many_readers_at_once(tmp_path: Path) -> None:
    """Each reader may hold buffers while it waits for parts: one participant's are capped; a
    session without one is read whole once complete, and gets one once a reader is free."""
    async def go() -> None:
        sessions = PartSessions(SpoolFiles(tmp_path))
        opened = [await sessions.open(("p0", 0, f"piece{i}"), claim(0), 1 << 30, lambda: None, 1.0)
                  for i in range(parts.MAX_READERS_PER_PID + 1)]
        for s in opened:
            sessions.consume(s, Reader())
        assert [s.consumer is not None for s in opened] == [True] * parts.MAX_READERS_PER_PID + [False]
        other = await sessions.open(("p1", 0, None), claim(0), 1 << 30, lambda: None, 1.0)
        sessions.consume(other, Reader())
        assert other.consumer is not None  # (per participant)
        sessions.drop(opened[0])
        with pytest.raises(Abandoned):
            await asyncio.wait_for(opened[0].consumer, 10)  # type: ignore[arg-type]
        sessions.consume(opened[-1], Reader())
        assert opened[-1].consumer is not None
        await sessions.stop()

    asyncio.run(go())
