"""transport/ranges.py: which part of a body a request's headers ask for (RFC 9110 §13, §14), and
the `Window` that lets only that part of a producer's writes through, from memory and from a file;
transport/parallel.py's `split` of a body into ranges."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from fedtrain.errors import Refused
from fedtrain.transport.parallel import StreamChooser, split
from fedtrain.transport.ranges import Ranged, Span, Window, decide, etag_of

ETAG = etag_of("xxh3-128:" + "ab" * 16)
BODY = bytes(range(256)) * 40  # 10240 bytes


@pytest.mark.parametrize("header, span", [
    ("bytes=0-99", (0, 100)), ("bytes=100-", (100, 10240)), ("bytes=-100", (10140, 10240)),
    ("bytes=10239-", (10239, 10240)), ("bytes=5-999999", (5, 10240)), ("bytes=-999999", (0, 10240)),
    ("Bytes = 7-8", (7, 9)),
])
def test_one_range_is_taken(header: str, span: tuple[int, int]) -> None:
    got = decide(len(BODY), ETAG, header, None, None)
    assert (got.start, got.stop, got.partial) == (*span, True)
    assert decide(len(BODY), ETAG, header, ETAG, ETAG) == got  # the validators match: the same


def test_without_a_range_or_with_a_stale_validator_the_whole_body() -> None:
    whole = Span(0, len(BODY), len(BODY), partial=False)
    assert decide(len(BODY), ETAG, None, None, None) == whole
    assert decide(len(BODY), ETAG, "bytes=5-", '"xxh3-128:' + "00" * 16 + '"', None) == whole
    assert decide(len(BODY), ETAG, "bytes=5-", "W/" + ETAG, None) == whole  # a weak one never matches
    assert decide(len(BODY), ETAG, "lines=5-", None, None) == whole


@pytest.mark.parametrize("header, status, code", [
    ("bytes=10240-", 416, "range_not_satisfiable"), ("bytes=-0", 416, "range_not_satisfiable"),
    ("bytes=1-2,4-5", 416, "too_many_ranges"), ("bytes=5-1", 416, "invalid_range"),
    ("bytes=x-", 416, "invalid_range"), ("bytes=--5", 416, "invalid_range"),
])
def test_refused_ranges(header: str, status: int, code: str) -> None:
    with pytest.raises(Refused) as info:
        decide(len(BODY), ETAG, header, None, None)
    assert (info.value.status, info.value.code) == (status, code)
    assert info.value.details["content_range"] == f"bytes */{len(BODY)}"


def test_if_match_is_a_hard_precondition() -> None:
    with pytest.raises(Refused) as info:
        decide(len(BODY), ETAG, "bytes=0-1", None, '"other"')
    assert info.value.status == 412
    assert decide(len(BODY), ETAG, None, None, f'"other", {ETAG}').partial is False


class Sender:
    """A `ModelSender` whose socket takes at most `take` bytes a write; a file's bytes are read."""

    def __init__(self, take: int = 1000, cut_at: int | None = None) -> None:
        self.got, self.take, self.cut_at = bytearray(), take, cut_at

    @property
    def sent(self) -> int:
        return len(self.got)

    def write_some(self, view: memoryview) -> int:
        n = min(self.take, view.nbytes)
        self.got += view[:n]
        return n

    def sendfile_steps(self, fd: int, offset: int, count: int) -> Iterator[None]:
        while count:
            if self.cut_at is not None and len(self.got) >= self.cut_at:
                raise ConnectionResetError("the client closed the connection")
            n = min(self.take, count)
            self.got += os.pread(fd, n, offset)
            offset, count = offset + n, count - n
            yield None

    def run(self, steps: Iterator[None]) -> None:
        for _ in steps:
            pass


class Producer:
    """A body of which the first `in_memory` bytes are written from memory, the rest sent from a file."""

    def __init__(self, fd: int, in_memory: int) -> None:
        self.fd, self.in_memory, self.closed = fd, in_memory, False

    def steps(self, out):  # type: ignore[no-untyped-def]
        view = memoryview(BODY)[: self.in_memory]
        while view:
            n = out.write_some(view[:4096])
            view = view[n:]
            yield None
        yield from out.sendfile_steps(self.fd, self.in_memory, len(BODY) - self.in_memory)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("in_memory", [0, 3000, len(BODY)])
@pytest.mark.parametrize("span", [(0, 10240), (0, 1), (2999, 3001), (5000, 10240), (10239, 10240), (123, 9876)])
def test_a_window_sends_exactly_its_bytes(in_memory: int, span: tuple[int, int]) -> None:
    with tempfile.TemporaryFile() as f:
        f.write(BODY)
        f.flush()
        producer, sent = Producer(f.fileno(), in_memory), []
        out = Sender()
        ranged = Ranged(producer, Span(*span, len(BODY)), sent.append, lambda: sent.append(-1))
        out.run(ranged.steps(out))
        ranged.close()
        assert bytes(out.got) == BODY[span[0]:span[1]]
        assert sum(n for n in sent if n > 0) == span[1] - span[0] and sent[-1] == -1 and producer.closed


def test_a_window_cut_midway_through_a_file_piece_counts_what_went(monkeypatch: pytest.MonkeyPatch) -> None:
    """A participant's bytes_down is what it was sent: the part of a file piece that went
    before the client left counts (it was lost when a piece counted only once it was whole)."""
    monkeypatch.setattr(Window, "FILE_PIECE", 4096)
    with tempfile.TemporaryFile() as f:
        f.write(BODY)
        f.flush()
        producer, sent = Producer(f.fileno(), 0), []
        out = Sender(take=1000, cut_at=6000)  # the cut falls inside the second 4096-byte piece
        ranged = Ranged(producer, Span(0, len(BODY), len(BODY)), sent.append)
        with pytest.raises(ConnectionResetError):
            out.run(ranged.steps(out))
        assert 4096 < len(out.got) < 8192 and sum(sent) == len(out.got)


@pytest.mark.parametrize("start, stop, parts, min_size, want", [
    (100, 1100, 4, 1, [(100, 350), (350, 600), (600, 850), (850, 1100)]),
    (0, 1000, 4, 400, [(0, 500), (500, 1000)]),  # none below min_size
    (0, 100, 8, 1000, [(0, 100)]),
    (0, 7, 16, 1, [(i, i + 1) for i in range(7)]),
])
def test_split_covers_the_range_contiguously(start: int, stop: int, parts: int, min_size: int,
                                             want: list[tuple[int, int]]) -> None:
    assert split(start, stop, parts, min_size) == want


def run_chooser(chooser: StreamChooser, rate_of: dict[int, float], downloads: int) -> list[int]:
    """The streams each of `downloads` downloads of 100 MB used, on a link where P streams move `rate_of[P]`."""
    used = []
    for _ in range(downloads):
        p = chooser.choose()
        used.append(p)
        chooser.record(p, 100_000_000, 100_000_000 / rate_of[p])
    return used


def test_auto_streams_doubles_while_it_pays_then_settles() -> None:
    # a link where one stream gets 30 MB/s and four fill it (100 MB/s): 8 do not pay more
    rates = {1: 30e6, 2: 60e6, 4: 100e6, 8: 104e6, 16: 104e6}
    used = run_chooser(StreamChooser(recheck=5), rates, 14)
    assert used[:4] == [1, 2, 4, 8]
    assert used[4:8] == [4] * 4 and used[8] == 8  # re-checked every `recheck` downloads, the probe counted
    assert used[9:] == [4] * 4 + [8]


def test_auto_streams_stays_at_one_on_a_link_one_stream_fills() -> None:
    used = run_chooser(StreamChooser(), dict.fromkeys((1, 2, 4), 100e6), 10)
    assert used == [1, 2] + [1] * 8


def test_auto_streams_ignores_small_downloads() -> None:
    chooser = StreamChooser()
    chooser.record(1, 1000, 0.001)
    assert chooser.choose() == 1 and chooser.rates == {}
