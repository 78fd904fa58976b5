"""An upload in parts through `Coordinator.receive_part`, read by the intake as its parts
arrive: when its reader is stopped short of an answer about the body (its participant marked
failed stops its receive into the sum), the next part starts a new reader from the first
byte, and the update still lands whole, as a whole upload's would."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fedtrain.coordinator import Coordinator
from fedtrain.coordinator.intake.parts import MIN_PART_BYTES, PartClaim
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.wire import digest_bytes
from tests.helpers.bodies import ADMIN_ID, chunked, raw_body
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.intake import assert_sum_is, updates

PART = MIN_PART_BYTES


def test_a_reader_stopped_by_its_participants_failure_starts_again_at_the_next_part(tmp_path: Path) -> None:
    svc = Coordinator(tmp_path / "state", tiny_config(model={"n_layer": 1, "n_embd": 64, "n_head": 2,
                                                             "block_size": 32}), Tokens([PTOKEN], ATOKEN))
    svc.open()
    pid = svc.join(ADMIN_ID, "solo", {})["participant_id"]
    # A second participant that never sends: with "solo" alone, its accepted update would be
    # every active participant's and the round could close (and merge, emptying the sum)
    # before the checks below read the open round.
    svc.join(ADMIN_ID, "idle", {})
    (delta,) = updates(svc, 1)
    data, whole = raw_body(delta)
    count = -(-len(data) // PART)
    assert count >= 3

    async def part(i: int) -> dict:
        claim = PartClaim(i, len(data), PART, whole, 10)
        chunk = data[i * PART : (i + 1) * PART]
        return await svc.receive_part(ADMIN_ID, pid, 0, claim, digest_bytes(chunk), len(chunk), chunked(chunk, 4096))

    async def reading() -> None:
        deadline = time.monotonic() + 20
        while svc.intake.receiving_direct != pid:  # (the reader has the header: it is receiving into the sum)
            assert time.monotonic() < deadline, "no reader is receiving the parts into the sum"
            await asyncio.sleep(0.005)

    async def scenario() -> None:
        assert (await part(0))["parts_complete"] is False
        await reading()
        svc.inspect().participants[pid].last_seen -= 10_000  # silent for longer than heartbeat_timeout_s
        svc.tick()  # marked failed: its receive into the sum stops
        assert svc.intake.receiving_direct is None and svc.inspect().sum_count == 0
        svc.heartbeat(ADMIN_ID, pid, {})  # back
        answers = [await part(1)]
        await reading()  # a new reader, from the first byte, before the last part
        answers += [await part(i) for i in range(2, count)]
        assert [a["parts_complete"] for a in answers] == [False] * (count - 2) + [True]
        assert answers[-1]["accepted"] is True and answers[-1]["duplicate"] is False

    asyncio.run(scenario())
    assert list(svc.inspect().submitted) == [pid]
    assert_sum_is(svc, delta)
    asyncio.run(svc.stop())
