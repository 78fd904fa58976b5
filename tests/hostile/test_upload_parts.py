"""Uploads in parts from a hostile participant (`coordinator/intake/parts.py`): every new
parameter bounded (part index, total, part size, length, the digests), parts that do not
fit their body refused before a byte is read, a session claiming more than max_upload_mb
refused with nothing held, a body in parts whose whole digest lies never counted, and no one
sends or reads parts as another participant. What an unfinished upload holds is reclaimed."""

from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake import parts
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.client.upload_parts import BodyParts
from fedtrain.wire import DIGEST_HEADER, EncodedBody, digest_bytes
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

PART = parts.MIN_PART_BYTES
WHOLE = "X-Fedtrain-Upload-Digest"
KEY = "X-Fedtrain-Participant-Key"


def config():  # type: ignore[no-untyped-def]
    return tiny_config(model={"n_layer": 1, "n_embd": 64, "n_head": 2, "block_size": 32})  # ~260 kB: 5 parts


def spool_bytes(c: BackgroundCoordinator) -> int:
    return sum(p.stat().st_size for p in c.service.spool.rglob("*") if p.is_file())


def reclaimed(c: BackgroundCoordinator) -> bool:
    """Whether the spool is empty within a few seconds: a session's file goes at its drop, and
    the copy its reader (the upload flow, reading parts as they come) made goes once that
    reader has seen the drop, a few turns of the event loop later."""
    deadline = time.monotonic() + 5
    while spool_bytes(c):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Sender:
    """Speaks as participant `pid` with raw parts of `body`."""

    def __init__(self, c: BackgroundCoordinator, pid: str, seed: float = 0.01) -> None:
        self.client = CoordinatorClient(c.url, PTOKEN)
        self.client.join(pid)
        self.pid = pid
        self.key = self.client.participant_key(pid) or ""
        self.http = httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}", KEY: self.key},
                                 timeout=30)
        self.enc = EncodedBody({n: torch.full_like(t, seed) for n, t in c.service.inspect().weights.items()})
        self.data = b"".join(bytes(x) for x in self.enc)
        self.parts = BodyParts(self.enc, PART)

    def put(self, index: int, *, data: bytes | None = None, digest: str | None = None, whole: str | None = None,
            pid: str | None = None, round_: int = 0, **params: object) -> httpx.Response:
        start, stop = self.parts.span(min(index, self.parts.count - 1))
        body = self.data[start:stop] if data is None else data
        query = {"tokens": 100, "part": index, "total": len(self.data), "part_bytes": PART, **params}
        headers = {DIGEST_HEADER: digest or digest_bytes(body), WHOLE: whole or self.enc.digest()}
        return self.http.put(f"/v1/rounds/{round_}/updates/{pid or self.pid}", params=query, content=body,
                             headers=headers)

    def held(self, pid: str | None = None) -> httpx.Response:
        return self.http.get(f"/v1/rounds/0/updates/{pid or self.pid}/parts")

    def close(self) -> None:
        self.http.close()
        self.client.close()


@pytest.fixture
def run(tmp_path: Path):  # type: ignore[no-untyped-def]
    with BackgroundCoordinator(tmp_path / "state", config()) as c:
        yield c


def code(r: httpx.Response) -> str:
    return r.json()["error"]["code"] if r.status_code >= 400 and "error" in r.json() else r.json().get("detail", "")


@pytest.mark.parametrize(("params", "status"), [
    ({"part": -1}, 422), ({"part": parts.MAX_PARTS}, 422),
    ({"total": 0}, 422), ({"total": 1 << 45}, 422),
    ({"part_bytes": PART - 1}, 422), ({"part_bytes": parts.MAX_PART_BYTES + 1}, 422),
    ({"part": "x"}, 422),
])
def test_part_parameters_out_of_their_bounds_are_refused_by_the_schema(run: BackgroundCoordinator, params: dict,
                                                                        status: int) -> None:
    s = Sender(run, "p0")
    try:
        before = spool_bytes(run)
        r = s.put(0, **params)
        assert r.status_code == status, r.text
        assert s.held().status_code == 404  # nothing opened
        assert spool_bytes(run) == before
    finally:
        s.close()


def test_parts_that_do_not_fit_their_body_are_refused_before_a_byte_is_held(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    try:
        n = s.parts.count
        assert n >= 3
        # a part past the last of the body
        r = s.put(n)
        assert (r.status_code, code(r)) == (400, "part_out_of_range")
        # a body that fits one part goes whole
        r = s.put(0, total=PART, data=s.data[:PART])
        assert (r.status_code, code(r)) == (400, "part_not_needed")
        # more parts than one body may come in
        r = s.put(0, total=(parts.MAX_PARTS + 1) * PART)
        assert r.status_code in (400, 413) and code(r) in ("too_many_parts", "too_large")
        # a part longer or shorter than its byte range: no overlap with the next, no gap
        start, stop = s.parts.span(1)
        for wrong in (s.data[start : stop + 1], s.data[start : stop - 1]):
            r = s.put(1, data=wrong)
            assert (r.status_code, code(r)) == (400, "part_length")
        # the claims come all together, or not at all
        r = s.http.put("/v1/rounds/0/updates/p0", params={"tokens": 100, "part": 0}, content=s.data[:PART],
                       headers={DIGEST_HEADER: digest_bytes(s.data[:PART])})
        assert (r.status_code, code(r)) == (400, "part_fields")
        # a malformed whole digest
        r = s.put(0, whole="md5:abc")
        assert r.status_code == 400
        assert s.held().status_code == 404
        assert spool_bytes(run) == 0
    finally:
        s.close()


def test_a_session_claiming_more_than_max_upload_mb_is_refused_and_holds_nothing(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    try:
        limit = int(run.service.config.max_upload_mb * 1_000_000)
        r = s.put(0, total=limit + 1)
        assert (r.status_code, code(r)) == (413, "too_large")
        # several sessions (one per piece label) count together against the same bound
        half = limit // 2 + PART
        r1 = s.put(0, total=half, piece="a")
        assert r1.status_code == 200, r1.text
        r2 = s.put(0, total=half, piece="b")
        assert (r2.status_code, code(r2)) == (413, "too_large")
        assert spool_bytes(run) <= half
    finally:
        s.close()


def test_a_part_with_a_wrong_digest_is_refused_and_not_held(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    try:
        r = s.put(1, digest=digest_bytes(b"something else"))
        assert (r.status_code, code(r)) == (400, "part_digest_mismatch")
        assert s.held().json()["held"] == []
        assert s.put(1).status_code == 200  # sent again, right
        assert s.held().json()["held"] == [1]
    finally:
        s.close()


def test_parts_whose_whole_digest_lies_are_never_counted(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    try:
        lie = digest_bytes(b"not this body")
        answers = [s.put(i, whole=lie) for i in range(s.parts.count)]
        assert all(a.status_code == 200 for a in answers[:-1])
        assert answers[-1].status_code == 400, answers[-1].text  # the whole body's digest is checked
        assert run.service.submissions(0) == []
        assert s.held().status_code == 404  # the session is gone with its bytes
        assert spool_bytes(run) == 0
    finally:
        s.close()


def test_a_newer_body_replaces_the_session_of_an_older(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    newer = Sender(run, "p1", seed=0.02)  # (its body; sent as p0's)
    try:
        assert s.put(0).status_code == 200 and s.put(1).status_code == 200
        assert s.held().json()["held"] == [0, 1]
        r = newer.http.put("/v1/rounds/0/updates/p0", params={"tokens": 100, "part": 2, "total": len(newer.data),
                                                             "part_bytes": PART},
                           content=newer.data[2 * PART : 3 * PART],
                           headers={DIGEST_HEADER: digest_bytes(newer.data[2 * PART : 3 * PART]),
                                    WHOLE: newer.enc.digest(), KEY: s.key})
        assert r.status_code == 200, r.text
        view = s.held().json()
        assert (view["digest"], view["held"]) == (newer.enc.digest(), [2])  # the newer won; the older's parts went
    finally:
        s.close()
        newer.close()


def test_no_one_sends_or_reads_parts_as_another_participant(run: BackgroundCoordinator) -> None:
    p0, p1 = Sender(run, "p0"), Sender(run, "p1")
    try:
        assert p0.put(0).status_code == 200
        r = p1.put(1, pid="p0")  # p1's key, p0's name
        assert r.status_code in (401, 403), r.text
        assert p1.held(pid="p0").status_code in (401, 403)
        assert p0.held().json()["held"] == [0]
        with httpx.Client(base_url=run.url, headers={"Authorization": "Bearer wrong"}) as stranger:
            assert stranger.get("/v1/rounds/0/updates/p0/parts").status_code == 401
    finally:
        p0.close()
        p1.close()


def test_parts_of_an_upload_never_finished_go_with_their_round(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", config().model_copy(update={"round_timeout_s": 1.0})) as c:
        s, other = Sender(c, "p0"), Sender(c, "p1")
        try:
            assert s.put(0).status_code == 200 and s.put(1).status_code == 200
            assert spool_bytes(c) > 0
            assert other.client.upload(0, "p1", other.enc, tokens=100)["accepted"] is True
            assert other.client.wait_round(0, "p1", wait_s=10)["state"] != "open"  # closed at its deadline
            # the next part anyone sends reclaims the parts of a round that takes no update now
            r = other.put(0, round_=1)
            assert r.status_code == 200, r.text
            assert s.held().status_code == 404
            assert spool_bytes(c) == len(other.data)  # p1's session only
            r = s.put(2)  # a part for the round gone: refused from its headers, nothing held
            assert r.status_code == 409 and spool_bytes(c) == len(other.data)
        finally:
            s.close()
            other.close()


def test_parts_of_an_upload_never_finished_are_reclaimed(run: BackgroundCoordinator) -> None:
    s = Sender(run, "p0")
    try:
        assert s.put(0).status_code == 200 and s.put(2).status_code == 200
        assert spool_bytes(run) >= len(s.data) - PART  # the session's file, its size
        s.client.leave("p0")
        assert reclaimed(run)
        s2 = Sender(run, "p2")
        assert s2.put(0).status_code == 200
        with httpx.Client(base_url=run.url, headers={"Authorization": f"Bearer {ATOKEN}"}) as admin:
            assert admin.post("/v1/participants/p2/evict").status_code == 200
        assert reclaimed(run)
        s2.close()
        assert math.ceil(len(s.data) / PART) == s.parts.count
    finally:
        s.close()


def test_a_participant_streams_at_most_so_many_parts_at_once(run: BackgroundCoordinator) -> None:
    """Each part streaming in holds receive buffers: one participant's are capped, however many
    connections it opens (its other parts are told to come back: 429 with Retry-After)."""
    s = Sender(run, "p0")
    total = (parts.MAX_STREAMING_PER_PID + 4) * PART
    socks: list[socket.socket] = []
    try:
        fill_streaming_slots(run, s, total, socks)
        r = s.put(parts.MAX_STREAMING_PER_PID, data=b"\0" * PART, total=total, whole=digest_bytes(b"whole"))
        assert (r.status_code, code(r)) == (429, "too_many_parts_in_flight"), r.text
        assert r.json()["error"]["details"]["retry_after_s"] > 0
    finally:
        for sock in socks:
            sock.close()
        s.close()


def test_a_part_over_the_cap_waits_briefly_and_goes_in_once_a_slot_frees(run: BackgroundCoordinator,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A client starts its next part once the last one's bytes are written, and the coordinator
    may still be reading their tail: a part over the cap waits (at most `SLOT_WAIT_S`) for one
    of its participant's parts to end, rather than being refused at once."""
    monkeypatch.setattr(parts, "SLOT_WAIT_S", 30.0)  # (a loaded machine's delays do not decide it)
    s = Sender(run, "p0")
    total = (parts.MAX_STREAMING_PER_PID + 4) * PART
    socks: list[socket.socket] = []
    try:
        fill_streaming_slots(run, s, total, socks)
        got: list[httpx.Response] = []
        late = threading.Thread(target=lambda: got.append(
            s.put(parts.MAX_STREAMING_PER_PID, data=b"\0" * PART, total=total, whole=digest_bytes(b"whole"))))
        late.start()
        time.sleep(0.3)  # (it waits; should it come later, a slot is free by then and it goes in at once)
        socks.pop(0).close()  # one part's connection ends: its slot is free
        late.join(30)
        assert got and got[0].status_code == 200, got[0].text if got else "no answer"
        assert parts.MAX_STREAMING_PER_PID in s.held().json()["held"]
    finally:
        for sock in socks:
            sock.close()
        s.close()


def fill_streaming_slots(c: BackgroundCoordinator, s: Sender, total: int, socks: list[socket.socket]) -> None:
    """As many stalled parts (`stalled_part`, into `socks`) as one participant may stream at
    once, and wait until the coordinator shows them all streaming."""
    for i in range(parts.MAX_STREAMING_PER_PID):
        socks.append(stalled_part(c, s, i, total))
    deadline = time.monotonic() + 20
    while len(s.held().json().get("streaming", [])) < parts.MAX_STREAMING_PER_PID:
        assert time.monotonic() < deadline, "the parts never began to stream"
        time.sleep(0.05)


def stalled_part(c: BackgroundCoordinator, s: Sender, index: int, total: int) -> socket.socket:
    """A connection that sends part `index` of a body of `total` bytes, 1000 bytes of it, and goes silent."""
    head = (f"PUT /v1/rounds/0/updates/p0?tokens=100&part={index}&total={total}&part_bytes={PART} HTTP/1.1\r\n"
            f"Host: x\r\nAuthorization: Bearer {PTOKEN}\r\n{KEY}: {s.key}\r\n{DIGEST_HEADER}: {digest_bytes(b'x')}\r\n"
            f"{WHOLE}: {digest_bytes(b'whole')}\r\nContent-Length: {PART}\r\n\r\n").encode()
    sock = socket.create_connection((c.host, c.port), timeout=10)
    sock.sendall(head + b"\0" * 1000)
    return sock
