"""`transfer.streams: auto` (`participant/client/upload_parts.py` `probe_streams`): the
connections of an upload in parts grow while they pay and stay at one where they do not; and
`BodyParts` cuts a body into parts that are its bytes, bit for bit."""

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

    def send(self, index: int) -> dict[str, Any]:
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
    link = Link(0.02, shared=True)
    probe_streams(list(range(24)), link.send)
    assert sorted(link.sent) == list(range(24))
    assert link.most <= 2  # one round of two to see that it does not pay, then one


def test_parts_are_the_bodys_bytes_and_go_as_many_at_once_as_asked() -> None:
    body = EncodedBody({"a": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 7)})
    whole = b"".join(bytes(c) for c in body)
    parts = BodyParts(body, 64 << 10)
    got = [b"".join(bytes(c) for c in parts.chunks(i)) for i in range(parts.count)]
    assert b"".join(got) == whole
    assert [parts.digest(i) for i in range(parts.count)] == [digest_bytes(g) for g in got]
    link = Link(0.01, shared=False)
    send_parts(parts, list(range(parts.count)), 3, lambda i: link.send(i))
    assert link.most == 3 and sorted(link.sent) == list(range(parts.count))
