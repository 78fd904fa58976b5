"""`transfer.streams: auto` (`participant/client/upload_parts.py` `probe_streams`): the
connections of an upload in parts grow while they pay and stay at one where they do not;
`BodyParts` cuts a body into parts that are its bytes, bit for bit; and a part whose bytes
are written frees its stream for the next while it waits for its answer."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from fedtrain.participant.client.upload_parts import BodyParts, probe_streams, send_parts
from fedtrain.wire import EncodedBody, digest_bytes


class Link:
    """Parts cost `per_part_s` each; `shared`: one at a time (a link one connection fills),
    else side by side (a link each connection gets its own share of)."""

    def __init__(self, per_part_s: float, shared: bool) -> None:
        self.per_part_s, self.shared = per_part_s, shared
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.now, self.most, self.sent = 0, 0, []  # type: ignore[var-annotated]

    def send(self, index: int, written: Any = None) -> dict[str, Any]:
        with self._count:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self.shared:
                with self._lock:
                    time.sleep(self.per_part_s)
            else:
                time.sleep(self.per_part_s)
        finally:
            with self._count:
                self.now -= 1
                self.sent.append(index)
        return {"parts_complete": index == 63}


def test_auto_grows_the_connections_where_each_gets_its_own_share() -> None:
    link = Link(0.2, shared=False)  # (long enough that a loaded machine's scheduling is noise)
    answer = probe_streams(list(range(64)), link.send)
    assert answer == {"parts_complete": True}
    assert sorted(link.sent) == list(range(64))
    assert link.most >= 4


def test_auto_stays_at_one_connection_where_one_fills_the_link() -> None:
    link = Link(0.1, shared=True)  # (long enough that a loaded machine's oversleeping is noise)
    probe_streams(list(range(12)), link.send)
    assert sorted(link.sent) == list(range(12))
    assert link.most <= 2  # one round of two to see that it does not pay, then one


def test_parts_are_the_bodys_bytes_and_go_as_many_at_once_as_asked() -> None:
    body = EncodedBody({"a": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 7)})
    whole = b"".join(bytes(c) for c in body)
    parts = BodyParts(body, 64 << 10)
    got = [b"".join(bytes(c) for c in parts.chunks(i)) for i in range(parts.count)]
    assert b"".join(got) == whole
    assert [parts.digest(i) for i in range(parts.count)] == [digest_bytes(g) for g in got]
    link = Link(0.01, shared=False)
    send_parts(parts, list(range(parts.count)), 3, lambda i, written: link.send(i))
    assert link.most == 3 and sorted(link.sent) == list(range(parts.count))


class AnsweredLate:
    """Parts whose bytes take `write_s` and whose answer comes `answer_s` after them (the
    coordinator checking the last part's bytes): when each part began writing, and how many
    wrote at once."""

    def __init__(self, write_s: float, answer_s: float, last: int) -> None:
        self.write_s, self.answer_s, self.last = write_s, answer_s, last
        self._lock = threading.Lock()
        self.writing, self.most_writing = 0, 0
        self.began: dict[int, float] = {}
        self.answered: dict[int, float] = {}

    def send(self, index: int, written: Any) -> dict[str, Any]:
        with self._lock:
            self.began[index] = time.monotonic()
            self.writing += 1
            self.most_writing = max(self.most_writing, self.writing)
        time.sleep(self.write_s)
        with self._lock:
            self.writing -= 1
        written()
        time.sleep(self.answer_s)
        with self._lock:
            self.answered[index] = time.monotonic()
        return {"parts_complete": index == self.last}


def test_the_next_part_writes_while_the_last_one_waits_for_its_answer() -> None:
    # (each part's start is at least 0.25 s ahead of the answer it is compared with, pipelined;
    # one turnaround per part puts it after that answer)
    link = AnsweredLate(0.25, 0.25, last=3)
    body = EncodedBody({"a": torch.zeros(4 * (64 << 10) // 4)})
    answer = send_parts(BodyParts(body, 64 << 10), list(range(4)), 1, link.send)
    assert answer == {"parts_complete": True}
    assert sorted(link.began) == list(range(4))
    assert link.most_writing == 1  # one stream's worth of bytes at a time
    assert all(link.began[i + 1] < link.answered[i] for i in range(3))  # not one turnaround per part


def test_a_part_that_fails_stops_the_parts_not_yet_begun() -> None:
    began: list[int] = []

    def send(index: int, written: Any) -> dict[str, Any]:
        began.append(index)
        if index == 1:
            raise OSError("the link broke")
        written()
        time.sleep(0.05)
        return {}

    body = EncodedBody({"a": torch.zeros(8 * (64 << 10) // 4)})
    try:
        send_parts(BodyParts(body, 64 << 10), list(range(8)), 1, send)
    except OSError:
        pass
    else:
        raise AssertionError("the failure was not raised")
    assert len(began) < 8
