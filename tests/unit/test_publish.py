"""Serving the global model (`publish.py`): streamed chunks (the plain adapter over the
steps), the worker-thread pump, downloads held back until their round commits (commit
first) or not (publish_first), and the committed model still served from memory until the
weights move on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import Coordinator
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.publish import ModelStream, NotCommitted, Published, WeightsGuard
from fedtrain.transport.chunks import chunks_of
from fedtrain.transport.send import SocketOut
from fedtrain.wire import EncodedBody, write_file
from tests.helpers.bodies import ADMIN_ID, chunked, collect, pumped, raw_body
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config


@pytest.mark.parametrize("slow_disk", [False, True])
def test_model_stream_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_disk: bool) -> None:
    """Read in the event loop while reads are fast; after a slow one, on a worker thread."""
    from fedtrain.transport import chunks

    t = {"a": torch.randn(1_000_000), "b": torch.randn(10)}  # 4 MB: 8 chunks
    digest = write_file(tmp_path / "g", t, {"version": "3"})
    data = (tmp_path / "g").read_bytes()
    hops: list[int] = []
    threaded = chunks.read_chunks
    monkeypatch.setattr(chunks, "read_chunks", lambda fd, at, end, n: hops.append(n) or threaded(fd, at, end, n))
    # every read counts as slow, or none does (a loaded machine must not make a fast read slow)
    monkeypatch.setattr(chunks, "SLOW_READ_S", -1.0 if slow_disk else float("inf"))
    files = CheckpointDir(tmp_path)
    s = ModelStream(3, digest, len(data), tmp_path / "g", files)
    files.remove(7)  # a prune meanwhile: nothing to do with the file being read
    assert collect(s) == data
    assert bool(hops) == slow_disk  # the first chunk came from the loop, the rest from the thread
    assert files.open_readers == 0  # the reader was counted out


def test_model_stream_from_memory_switches_to_the_file_when_the_weights_move(tmp_path: Path) -> None:
    t = {"a": torch.randn(3_000_000), "b": torch.randn(1000)}  # 12 MB: several chunks
    body = EncodedBody(t, {"version": "1"})
    guard = WeightsGuard()
    published = Published(1, body.digest(), body, guard.epoch)
    write_file(tmp_path / "g", t, {"version": "1"})  # the commit, done meanwhile
    published.settle(True)
    expected = (tmp_path / "g").read_bytes()
    stream = ModelStream(1, published.digest, body.content_length, tmp_path / "g", CheckpointDir(tmp_path), published,
                         guard)
    assert collect(stream) == expected

    def next_outer_step(n: int) -> None:  # after the 2nd chunk the weights change in place
        if n == 2:
            with guard.lock:
                guard.epoch += 1
                t["a"].add_(1.0)

    stream = ModelStream(1, published.digest, body.content_length, tmp_path / "g", CheckpointDir(tmp_path), published,
                         guard)
    got = collect(stream, next_outer_step)
    assert got == expected  # the rest came from the committed file, not from the changed weights


def test_model_stream_pumps_the_file_and_switches_from_memory_when_the_weights_move(tmp_path: Path) -> None:
    t = {"a": torch.randn(3_000_000), "b": torch.randn(1000)}  # 12 MB
    body = EncodedBody(t, {"version": "1"})
    guard = WeightsGuard()
    published = Published(1, body.digest(), body, guard.epoch)
    write_file(tmp_path / "g", t, {"version": "1"})
    published.settle(True)
    expected = (tmp_path / "g").read_bytes()
    files = CheckpointDir(tmp_path)
    assert pumped(ModelStream(1, published.digest, len(expected), tmp_path / "g", files)) == expected  # sendfile
    assert pumped(ModelStream(1, published.digest, len(expected), tmp_path / "g", files, published, guard)) == expected
    moved = []

    def next_outer_step(n: int) -> None:  # a few MB in, the weights change in place
        if n > 3_000_000 and not moved:
            with guard.lock:
                guard.epoch += 1
                t["a"].add_(1.0)
            moved.append(n)

    got = pumped(ModelStream(1, published.digest, len(expected), tmp_path / "g", files, published, guard),
                 next_outer_step)
    assert moved and got == expected  # the rest came from the committed file, not from the changed weights
    assert files.open_readers == 0


def test_a_stalled_download_does_not_hold_the_weights_and_can_be_cancelled(tmp_path: Path) -> None:
    t = {"a": torch.randn(3_000_000)}
    body = EncodedBody(t, {"version": "1"})
    guard = WeightsGuard()
    published = Published(1, body.digest(), body, guard.epoch)
    stream = ModelStream(1, published.digest, body.content_length, tmp_path / "g", CheckpointDir(tmp_path),
                         published, guard)
    a, b = socket.socketpair()  # nobody reads b: the socket fills up and the pump waits
    a.setblocking(False)
    out = SocketOut(a.fileno())
    failed: list[BaseException] = []

    def run() -> None:
        try:
            stream.pump(out)
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while out.sent == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert 0 < out.sent < body.content_length
    assert guard.lock.acquire(timeout=2)  # the next outer step is not held up by the stalled client
    guard.lock.release()
    out.cancelled.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(failed[0], ConnectionAbortedError)
    b.close()  # and a client gone: the next write fails
    out2 = SocketOut(a.fileno())
    with pytest.raises(OSError):
        for _ in range(100):
            out2.sendall(memoryview(b"x" * 65536))
    a.close()


def held(t: dict[str, torch.Tensor]) -> tuple[Published, WeightsGuard, bytes, int]:
    """A model served from memory whose downloads wait for its commit; the bytes of its last piece."""
    body = EncodedBody(t, {"version": "1"})
    guard = WeightsGuard()
    published = Published(1, body.digest(), body, guard.epoch, hold=True)
    return published, guard, b"".join(bytes(v) for v in body), t["b"].numel() * 4


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("committed", [True, False])
def test_a_held_download_sends_its_last_piece_once_committed(tmp_path: Path, committed: bool) -> None:
    published, guard, expected, last = held({"a": torch.randn(3_000_000), "b": torch.randn(1000)})
    progress = [0]
    result: dict[str, object] = {}

    def download() -> None:
        stream = ModelStream(1, published.digest, len(expected), tmp_path / "g", CheckpointDir(tmp_path),
                             published, guard)
        try:
            result["got"] = pumped(stream, lambda n: progress.__setitem__(0, n))
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=download)
    thread.start()
    wait_until(lambda: progress[0] == len(expected) - last, "the download did not get all but its last piece")
    time.sleep(0.3)
    assert progress[0] == len(expected) - last and thread.is_alive()  # held
    published.settle(committed)
    thread.join(timeout=10)
    if committed:
        assert result["got"] == expected
    else:  # the commit failed: cut short, the last piece never sent
        assert isinstance(result["error"], NotCommitted) and progress[0] == len(expected) - last


@pytest.mark.parametrize("committed", [True, False])
def test_held_chunks_wait_for_the_commit(tmp_path: Path, committed: bool) -> None:
    published, guard, expected, last = held({"a": torch.randn(3_000_000), "b": torch.randn(1000)})
    stream = ModelStream(1, published.digest, len(expected), tmp_path / "g", CheckpointDir(tmp_path), published, guard)

    async def scenario() -> tuple[bytes, BaseException | None]:
        got = bytearray()

        async def read() -> None:
            async for chunk in chunks_of(stream):
                got.extend(chunk)

        task = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        assert len(got) == len(expected) - last and not task.done()
        published.settle(committed)
        error = None
        try:
            await task
        except NotCommitted as e:
            error = e
        return bytes(got), error

    got, error = asyncio.run(scenario())
    assert (got, error is None) == ((expected, True) if committed else (expected[:-last], False))


def test_a_download_that_moves_to_the_file_after_a_failed_commit_is_cut_short(tmp_path: Path) -> None:
    """A roll back moves the weights: an uncommitted version must not go on from its file."""
    published, guard, expected, _ = held({"a": torch.randn(3_000_000), "b": torch.randn(1000)})
    published.hold = False  # publish_first: nothing held, but the file is not the committed model
    write_file(tmp_path / "g", {"a": torch.zeros(3_000_000), "b": torch.zeros(1000)}, {"version": "1"})
    published.settle(False)

    def roll_back(n: int) -> None:
        if n > 3_000_000 and guard.epoch == published.epoch:
            with guard.lock:
                guard.epoch += 1

    stream = ModelStream(1, published.digest, len(expected), tmp_path / "g", CheckpointDir(tmp_path), published, guard)
    with pytest.raises(NotCommitted):
        pumped(stream, roll_back)


def publishing_coordinator(tmp_path: Path, publish_first: bool = True) -> Coordinator:
    svc = Coordinator(tmp_path / "state", tiny_config(publish_first=publish_first, min_participants=2),
                      Tokens([PTOKEN], ATOKEN))
    svc.open()
    for name in ("a", "b"):
        svc.join(ADMIN_ID, name, {})
    return svc


async def close_round(svc: Coordinator) -> None:
    """Both participants upload round 0; returns once round 1 is served (from memory)."""
    g = torch.Generator().manual_seed(0)
    for pid in ("a", "b"):
        data, digest = raw_body({k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in svc.inspect().weights.items()})
        await svc.receive_update(ADMIN_ID, pid, 0, 10, digest, len(data), chunked(data, 4096))
    while svc.version != 1:
        await asyncio.sleep(0.01)


async def fetch(svc: Coordinator, pid: str) -> bytes:
    stream = svc.model_stream(None, pid)
    return b"".join([c async for c in chunks_of(stream)])


def test_publish_first_commits_at_once_and_downloads_end_before_it(tmp_path: Path) -> None:
    """The commit starts as soon as the round is merged, fetched or not; a download in the
    meantime is not held back, and it carries the bytes the commit then writes."""
    svc = publishing_coordinator(tmp_path)

    async def scenario() -> None:
        with faults.inject("checkpoint.after_global_write", "sleep", seconds=1.0, round=0):
            await close_round(svc)
            assert svc.committer.published is not None and not svc.committer.published.hold
            served = await fetch(svc, "a")  # not held: done while the commit sleeps
            assert svc.inspect().committed_version == 0  # it ended while the commit still sleeps: not held back
            deadline = time.monotonic() + 10
            while svc.inspect().committed_version != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        assert svc.inspect().committed_version == 1  # nobody else fetched it: the commit did not wait for b
        assert served == svc.inspect().checkpoints.global_path(1).read_bytes()  # what was served is what was committed
        assert svc.model_stream(None, "b").memory is svc.committer.published  # still served from memory
        assert served == await fetch(svc, "b")
        await svc.stop()

    asyncio.run(scenario())


def test_commit_first_serves_the_model_during_the_commit_and_completes_downloads_after_it(tmp_path: Path) -> None:
    svc = publishing_coordinator(tmp_path, publish_first=False)

    async def scenario() -> None:
        await svc.start()  # (long-polls)
        with faults.inject("checkpoint.after_global_write", "sleep", seconds=1.0, round=0):
            await close_round(svc)  # the next round is open while the commit is under way
            assert svc.inspect().committed_version == 0
            assert svc.committer.published is not None and svc.committer.published.hold
            assert (await svc.wait_round(ADMIN_ID, "a", 0, 5))["state"] == "committing"  # a participant goes on
            observer = asyncio.create_task(svc.wait_round(ADMIN_ID, None, 0, 5))  # anyone else: until committed
            stream = svc.model_stream(None, "a")
            assert stream.memory is not None
            chunks = chunks_of(stream)
            first = await anext(chunks)  # served at once, from memory
            assert svc.inspect().committed_version == 0 and not observer.done()
            rest = b"".join([c async for c in chunks])
            assert svc.inspect().committed_version == 1  # the download ended only once the round was committed
            assert (await observer)["state"] == "closed"
        assert first + rest == svc.inspect().checkpoints.global_path(1).read_bytes()
        await svc.stop()

    asyncio.run(scenario())


def test_commit_first_cuts_downloads_short_when_the_commit_fails(tmp_path: Path) -> None:
    svc = publishing_coordinator(tmp_path, publish_first=False)

    async def scenario() -> None:
        with faults.inject("checkpoint.after_global_write", "sleep", seconds=0.5, round=0), \
                faults.inject("commit.before_db", "raise", round=0):
            await close_round(svc)  # (the commit takes long enough for round 1 to be seen open)
            stream = svc.model_stream(None, "a")
            with pytest.raises(NotCommitted):
                async for _ in chunks_of(stream):
                    pass
            while svc.version != 0 or svc.status()["closing"]:  # gone back to the last committed round
                await asyncio.sleep(0.01)
        assert svc.inspect().committed_version == 0 and svc.model_stream(None, "a").memory is None
        assert not svc.inspect().checkpoints.global_path(1).exists()
        await svc.stop()

    asyncio.run(scenario())
