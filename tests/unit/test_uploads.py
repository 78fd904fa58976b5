"""The intake of the open round's updates, through `Coordinator.receive_update`: values checked
where it costs least (NaN, Inf, magnitude), the direct receive into the sum and what stops it,
the folds beside it; a refused update leaves the sum exactly as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import Coordinator
from fedtrain.coordinator.intake.folds import Pending, RoundSum
from fedtrain.coordinator.intake.spool import SpoolFiles
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.policy import DIRECT_MAX_ACTIVE
from fedtrain.errors import Refused, WireError
from fedtrain.wire.compress import compress
from tests.helpers.bodies import ADMIN_ID, chunked, raw_body
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.intake import assert_sum_is, expected_sum, updates

POISON = {"note": "\u0080\x7f" * 40}
BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def place(t: dict[str, torch.Tensor], where: str, value: float) -> str:
    """Put `value` into `t` (in place) in the middle of a tensor or as the last element of the
    last tensor; returns the tensor's name."""
    names = [n for n, v in t.items() if v.is_floating_point() and v.numel() > 8]
    name = names[len(names) // 2] if where == "middle" else list(t)[-1]
    t[name].view(-1)[t[name].numel() // 2 if where == "middle" else -1] = value
    return name


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Coordinator]:
    svc = Coordinator(tmp_path / "state", tiny_config(), Tokens([PTOKEN], ATOKEN))
    svc.open()
    for name in ("a", "b"):  # two, so that one upload leaves the round open
        svc.join(ADMIN_ID, name, {})
    yield svc
    asyncio.run(svc.stop())


def upload(svc: Coordinator, t: dict[str, torch.Tensor], meta: dict[str, str] | None = None,
           size: int = 1001, pid: str = "a") -> dict:
    data, digest = raw_body(t, meta)
    return asyncio.run(svc.receive_update(ADMIN_ID, pid, 0, 10, digest, len(data), chunked(data, size)))


def assert_untouched(svc: Coordinator) -> None:
    assert svc.version == 0 and svc.inspect().submitted == {} and svc.inspect().sum_count == 0
    # The sum holds no contribution: whatever its memory holds is written over by the next one.
    assert svc.inspect().sum_empty
    assert list(svc.spool.iterdir()) == []  # the refused upload's new spool file is gone


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("value", BAD_VALUES)
def test_coordinator_refuses_a_non_finite_plain_upload(service: Coordinator, monkeypatch: pytest.MonkeyPatch,
                                                       where: str, value: float) -> None:
    monkeypatch.setattr("fedtrain.coordinator.intake.receive.BATCH", 4096)  # batches of 5 chunks of 1001 bytes
    service.intake.set_piece_bytes(64)  # read back in many pieces
    t = {n: torch.randn(v.shape) for n, v in service.inspect().weights.items()}
    name = place(t, where, value)
    with pytest.raises(Refused) as refused:
        upload(service, t, POISON)
    assert (refused.value.status, refused.value.code) == (422, "non_finite")
    assert refused.value.message == f"tensor {name} contains NaN or Inf; the update was refused"
    assert_untouched(service)
    t[name].nan_to_num_(0.0, 0.0, 0.0)
    assert upload(service, t, POISON)["accepted"] and service.inspect().sum_count == 1  # the same layout, finite
    assert_sum_is(service, t)  # nothing of the refused one is left


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_non_finite_second_upload_leaves_the_sum_as_the_first_made_it(service: Coordinator, value: float,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    service.intake.set_piece_bytes(64)

    def no_read_back(*args: object, **kwargs: object) -> None:
        raise AssertionError("a plain spooled upload is checked as it arrives, not read back")

    monkeypatch.setattr(service.intake.round, "check_values", no_read_back)
    first = {n: torch.randn(v.shape) for n, v in service.inspect().weights.items()}
    assert upload(service, first)["accepted"]
    before = {n: v.clone() for n, v in service.inspect().sum_values.items()}
    second = {n: torch.randn(v.shape) for n, v in service.inspect().weights.items()}
    place(second, "last", value)
    with pytest.raises(Refused) as refused:
        upload(service, second, pid="b")
    assert (refused.value.status, refused.value.code) == (422, "non_finite")
    assert service.inspect().sum_count == 1 and list(service.inspect().submitted) == ["a"]
    assert all(torch.equal(service.inspect().sum_values[n], before[n]) for n in before)
    assert all(torch.equal(before[n], want) for n, want in expected_sum(service, first).items())


def test_coordinator_checks_a_compressed_upload_once_decoded(service: Coordinator) -> None:
    t = {n: torch.randn(v.shape) for n, v in service.inspect().weights.items()}
    name = list(t)[-1]
    t[name].view(-1)[-1] = float("inf")
    sent, meta = compress(t, "bf16")
    with pytest.raises(Refused) as refused:
        upload(service, sent, meta)
    assert (refused.value.status, refused.value.code) == (422, "non_finite")
    assert refused.value.message == f"tensor {name} contains NaN or Inf; the update was refused"
    assert_untouched(service)


# The round's first upload is written straight into the running sum (no spool file).


def coordinator(tmp_path: Path, **overrides: object) -> Coordinator:
    svc = Coordinator(tmp_path / "state", tiny_config(**overrides), Tokens([PTOKEN], ATOKEN))
    svc.open()
    for name in ("a", "b", "c"):  # three, so that two uploads leave the round open
        svc.join(ADMIN_ID, name, {})
    return svc


async def upload_beside(svc: Coordinator, pid: str, t: dict[str, torch.Tensor]) -> dict:
    """Upload `t` as `pid` while another upload is held: answered within 10 s."""
    data, digest = raw_body(t)
    return await asyncio.wait_for(svc.receive_update(ADMIN_ID, pid, 0, 10, digest, len(data), chunked(data, 4096)),
                                  timeout=10)


async def held_upload(svc: Coordinator, pid: str, t: dict[str, torch.Tensor], gate: asyncio.Event) -> asyncio.Task:
    """Start an upload of `t` whose body stops after 5000 bytes until `gate` is set (a slow or
    stalled link); returns once it is being written straight into the sum."""
    data, digest = raw_body(t)

    async def body() -> AsyncIterator[bytes]:
        yield data[:5000]
        await gate.wait()
        yield data[5000:]

    task = asyncio.create_task(svc.receive_update(ADMIN_ID, pid, 0, 10, digest, len(data), body()))
    while svc.intake.receiving_direct is None:
        await asyncio.sleep(0)
    return task


def test_the_first_upload_lands_in_the_sum_and_the_sum_is_what_spooling_gives(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    direct = coordinator(tmp_path / "direct")
    spooled = coordinator(tmp_path / "spooled", late_uploads="fold")  # a late fold needs the bytes in a file
    first, second = updates(direct, 2)
    taken: list[Path] = []
    real_take = SpoolFiles.take
    monkeypatch.setattr(SpoolFiles, "take", lambda self: taken.append(self.root) or real_take(self))
    for svc in (direct, spooled):
        assert upload(svc, first, size=777)["accepted"]
        assert upload(svc, second, size=777, pid="b")["accepted"]
        assert svc.inspect().sum_count == 2 and set(svc.inspect().submitted) == {"a", "b"}
    assert taken == [direct.spool, spooled.spool, spooled.spool]  # direct spooled only its second upload
    want = expected_sum(direct, first, second)
    for svc in (direct, spooled):
        assert all(torch.equal(svc.inspect().sum_values[n], want[n]) for n in want)
        asyncio.run(svc.stop())


def test_the_direct_receive_switch_spools_the_first_upload_with_the_same_sum(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDTRAIN_DIRECT_RECEIVE=0 (what the benchmark measures the receive into the sum by)
    turns that path off alone: the first upload lands in a spool file, the sum is the same."""
    monkeypatch.setenv("FEDTRAIN_DIRECT_RECEIVE", "0")
    svc = coordinator(tmp_path)
    (first,) = updates(svc, 1)
    assert upload(svc, first)["accepted"]
    assert svc.intake.last_path is not None and svc.intake.last_path.path == "spool"
    assert "fast IO" in svc.intake.last_path.reason
    assert_sum_is(svc, first)
    asyncio.run(svc.stop())


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_direct_upload_is_checked_finite_as_it_lands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      where: str, value: float) -> None:
    """Its values are scanned piece by piece as they are read into the sum (header bytes
    skipped, even ones that read as NaN), so counting it makes no second pass over them."""
    svc = coordinator(tmp_path)

    def no_second_pass(name: str, values: torch.Tensor) -> float:
        raise AssertionError("the direct upload's values were checked again after the scan")

    monkeypatch.setattr("fedtrain.coordinator.intake.folds.check_piece", no_second_pass)
    good, bad = updates(svc, 2)
    name = place(bad, where, value)
    with pytest.raises(Refused) as refused:
        upload(svc, bad, POISON, size=997)
    assert (refused.value.status, refused.value.code, refused.value.message) == (
        422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")
    assert_untouched(svc)
    assert upload(svc, good, POISON, size=997)["accepted"] and svc.inspect().sum_count == 1
    assert_sum_is(svc, good)
    asyncio.run(svc.stop())


def test_a_bad_direct_upload_leaves_the_sum_empty(tmp_path: Path) -> None:
    svc = coordinator(tmp_path)
    good, bad = updates(svc, 2)
    data, digest = raw_body(bad)
    corrupt = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    cases = [(corrupt, "digest mismatch"), (data[: len(data) // 2], "truncated|ended|incomplete|short")]
    for body, message in cases:
        with pytest.raises(WireError, match=message):
            asyncio.run(svc.receive_update(ADMIN_ID, "a", 0, 10, digest, len(data), chunked(body, 999)))
        assert_untouched(svc)
        assert svc.intake.receiving_direct is None
    place(bad, "middle", float("nan"))
    with pytest.raises(Refused) as non_finite:
        upload(svc, bad)
    assert (non_finite.value.status, non_finite.value.code) == (422, "non_finite")
    assert_untouched(svc)
    assert upload(svc, good)["accepted"]
    assert_sum_is(svc, good)
    asyncio.run(svc.stop())


def test_a_close_stops_a_direct_upload_and_nothing_waits_for_it(tmp_path: Path) -> None:
    svc = coordinator(tmp_path)
    first, second = updates(svc, 2)

    async def scenario() -> None:
        gate = asyncio.Event()
        slow = await held_upload(svc, "a", first, gate)
        await asyncio.sleep(0.01)
        assert svc.intake.receiving_direct == "a"
        svc.rounds.open.closing = True  # what a close does first (here without merging, which needs uploads)
        svc.intake.abort_direct()
        assert svc.intake.receiving_direct is None and svc.inspect().sum_count == 0
        svc.rounds.open.closing = False
        # The next upload is not held up by the stalled one, and is itself written straight in.
        got = await upload_beside(svc, "b", second)
        assert got["accepted"] and list(svc.inspect().submitted) == ["b"]
        gate.set()
        with pytest.raises(Refused) as refused:
            await slow
        assert (refused.value.status, refused.value.code) == (409, "round_closed")
        assert_sum_is(svc, second)  # nothing of the stopped upload is in the sum

    asyncio.run(scenario())
    asyncio.run(svc.stop())


@pytest.mark.parametrize("size", [1, 3, 8, 10_000])
def test_peek_header_reads_ahead_and_gives_every_byte_back(size: int) -> None:
    from fedtrain.coordinator.intake.receive import peek_header

    data, _ = raw_body({"w": torch.arange(6.0), "b": torch.ones(2)}, {"k": "v"})

    async def run() -> tuple[object, bytes]:
        head, body = await peek_header(chunked(data, size))
        return head, await body.read(len(data) + 10)

    head, again = asyncio.run(run())
    assert again == data
    assert head is not None
    specs, meta = head
    assert set(specs) == {"w", "b"} and specs["w"].shape == (6,) and meta == {"k": "v"}
    garbage = asyncio.run(peek_header(chunked(b"\xff" * 64, 7)))[0]
    assert garbage is None  # not a header: the spooled receive reports why


def test_with_many_participants_active_the_first_upload_is_spooled(service: Coordinator,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """More than DIRECT_MAX_ACTIVE: too many folds could queue behind a direct receive, so it spools."""
    for name in ("c", "d", "e"):
        service.join(ADMIN_ID, name, {})
    assert len(service.inspect().participants) > DIRECT_MAX_ACTIVE
    (first,) = updates(service, 1)
    assert upload(service, first)["accepted"]
    assert service.intake.last_path is not None and service.intake.last_path.path == "spool"
    assert "participants are active" in service.intake.last_path.reason
    assert_sum_is(service, first)


def test_a_participant_marked_failed_stops_its_direct_upload(tmp_path: Path) -> None:
    svc = Coordinator(tmp_path / "state", tiny_config(), Tokens([PTOKEN], ATOKEN))
    svc.open()
    pid = svc.join(ADMIN_ID, "solo", {})["participant_id"]
    (delta,) = updates(svc, 1)

    async def scenario() -> None:
        gate = asyncio.Event()
        task = await held_upload(svc, pid, delta, gate)
        svc.inspect().participants[pid].last_seen -= 10_000  # silent for longer than heartbeat_timeout_s
        svc.tick()
        assert svc.intake.receiving_direct is None and svc.inspect().sum_count == 0
        gate.set()
        with pytest.raises(Refused) as refused:
            await task
        assert (refused.value.status, refused.value.code) == (503, "upload_interrupted")  # retried by the client

    asyncio.run(scenario())
    assert svc.inspect().participants[pid].state == "failed" and svc.inspect().submitted == {}
    asyncio.run(svc.stop())


def test_an_upload_beside_a_direct_one_is_answered_at_once_and_folded_after_it(tmp_path: Path) -> None:
    svc = coordinator(tmp_path)
    first, second = updates(svc, 2)

    async def scenario() -> None:
        gate = asyncio.Event()
        direct = await held_upload(svc, "a", first, gate)
        got = await upload_beside(svc, "b", second)
        assert got == {"accepted": True, "duplicate": False, "round": 0}  # not held up by the slow link
        inside = svc.inspect()
        assert set(inside.submitted) == {"b"} and svc.intake.folds_in_flight == 1 and inside.sum_count == 0  # waits
        gate.set()
        assert (await direct)["accepted"]
        await svc.intake.idle()

    asyncio.run(scenario())
    assert set(svc.inspect().submitted) == {"a", "b"} and svc.inspect().sum_count == 2 and svc.intake.failure is None
    assert_sum_is(svc, first, second)  # the direct one first, then the one that waited
    asyncio.run(svc.stop())


def test_a_failed_deferred_fold_stops_the_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = coordinator(tmp_path)
    first, second = updates(svc, 2)
    real = RoundSum.check_and_fold

    def broken(self: RoundSum, path: Path, weight: float, pending: Pending) -> str | None:
        if self.acc.count:  # the deferred one: the disk failed under it
            raise OSError("read error")
        return real(self, path, weight, pending)

    monkeypatch.setattr(RoundSum, "check_and_fold", broken)

    async def scenario() -> None:
        gate = asyncio.Event()
        direct = await held_upload(svc, "a", first, gate)
        assert (await upload_beside(svc, "b", second))["accepted"]
        gate.set()
        await direct
        await svc.intake.idle()
        svc.leave(ADMIN_ID, "c")  # a and b are in: the close merges, finds the failed fold, goes back
        for _ in range(6000):  # a bound, not a timing: a loaded machine may take seconds
            # the event is recorded as the going back starts: wait until the round is open again
            if any(e["kind"] == "merge_failed" for e in svc.store.events(20)) and not svc.status()["closing"]:
                break
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    failed = [e["message"] for e in svc.store.events(20) if e["kind"] == "merge_failed"]
    assert failed and "the fold of an accepted upload failed (read error)" in failed[0]
    assert svc.version == 0 and svc.inspect().submitted == {} and svc.intake.failure is None  # sent again from scratch
    asyncio.run(svc.stop())
