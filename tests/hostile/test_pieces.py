"""Pieces of an update from a hostile participant (`coordinator/intake/pieces.py`): however
many pieces it starts at once, at most one per rank of its group stream in (429 naming the
limit, with Retry-After, for the rest), and its unfinished pieces never hold more bytes than
the update sent whole may: memory and spool stay bounded (measured), and its honest pieces
still make its update after."""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake import pieces
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.api import client, deltas, halves, put, send_piece
from tests.helpers.config import PTOKEN, tiny_config

MODEL = {"n_embd": 128, "n_layer": 2, "n_head": 2, "block_size": 32}  # an update of 1.7 MB
# An update of 6.6 MB: half of it is more than the receive batches hold (`receive.BATCH`), so
# a half-sent piece has bytes in its spool file.
LARGER = {"n_embd": 256, "n_layer": 2, "n_head": 2, "block_size": 32}
ATTEMPTS = 32  # connections from one address, kept well below a per-address cap of the server
RANKS = 6


def rss_bytes() -> int:
    """This process's resident memory (the coordinator runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def spool_bytes(c: BackgroundCoordinator) -> int:
    return sum(p.stat().st_size for p in c.service.spool.rglob("*") if p.is_file())


def whole_piece(c: BackgroundCoordinator) -> tuple[bytes, str]:
    """A piece that claims every tensor whole: as large as the update."""
    enc = EncodedBody(deltas(c, 7))
    return b"".join(bytes(x) for x in enc), enc.digest()


def start_piece(c: BackgroundCoordinator, pid: str, label: str, body: bytes, digest: str, key: str) -> socket.socket:
    """A connection that sent the head of an upload of piece `label` and no byte of its body."""
    host, port = c.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (f"PUT /v1/rounds/0/updates/{pid}?tokens=100&piece={label} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {PTOKEN}\r\nX-Fedtrain-Participant-Key: {key}\r\n"
            f"{DIGEST_HEADER}: {digest}\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode())
    return sock


def answers(socks: list[socket.socket], enough: int, wait_s: float = 20.0) -> dict[int, tuple[int, dict, dict]]:
    """The answers that come, by index: (status, headers, JSON body); once `enough` came (or
    after `wait_s`), and those that come in the next 0.3 s."""
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    got: dict[int, bytes] = {}
    done: set[int] = set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(done) < len(socks):
        for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
            data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            got[key.data] = got.get(key.data, b"") + data
            if not data or b"}}" in got[key.data]:
                sel.unregister(key.fileobj)
                done.add(key.data)
        if len(done) >= enough:
            deadline = min(deadline, time.monotonic() + 0.3)
    sel.close()
    out = {}
    for i, raw in ((i, got[i]) for i in done):
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        out[i] = (int(lines[0].split()[1]), headers, json.loads(body) if body else {})
    return out


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[BackgroundCoordinator, str]]:
    """A coordinator whose participant p is an FSDP group of RANKS ranks; q is another."""
    with BackgroundCoordinator(tmp_path / "s", tiny_config(model=LARGER, max_upload_mb=64.0)) as c, \
            client(c) as http:
        joined = http.post("/v1/join", json={"name": "p", "info": {"parallel": "fsdp", "world_size": RANKS}}).json()
        assert http.post("/v1/join", json={"name": "q"}).status_code == 200
        yield c, joined["participant_key"]


def test_many_pieces_at_once_hold_one_per_rank_and_bounded_memory(group: tuple[BackgroundCoordinator, str]) -> None:
    c, key = group
    body, digest = whole_piece(c)
    half = len(body) // 2
    rss0, spool0 = rss_bytes(), spool_bytes(c)
    socks = [start_piece(c, "p", f"p{i}", body, digest, key) for i in range(ATTEMPTS)]
    try:
        refused = answers(socks, enough=ATTEMPTS - RANKS)
        assert len(refused) == ATTEMPTS - RANKS, f"{len(refused)} answered at once, {ATTEMPTS - RANKS} expected"
        for status, headers, answer in refused.values():
            assert status == 429 and answer["error"]["code"] == "pieces_in_flight", answer
            assert answer["error"]["details"]["limit"] == RANKS and headers["retry-after"] == "1"
            assert f"the most at once ({RANKS}" in answer["error"]["message"]
        streaming = [s for i, s in enumerate(socks) if i not in refused]
        for s in streaming:  # each sends half its body and stalls
            s.sendall(body[:half])
        time.sleep(0.5)  # (loopback: the halves are in the coordinator's buffers or spool files by now)
        held, grown = spool_bytes(c) - spool0, rss_bytes() - rss0
        print(f"\n{ATTEMPTS} pieces of {len(body):,} bytes started, half sent: {len(streaming)} streaming, "
              f"spool +{held / 1e6:.1f} MB, RSS +{grown / 1e6:.1f} MB")
        assert held <= RANKS * half  # (without the bound: every attempt's half, 5x more)
        assert grown < RANKS * (len(body) + 2 * (2 << 20)) + (16 << 20)
    finally:
        for s in socks:
            s.close()
    # the run goes on: the group's two honest ranks make p's update once the stalled ones are gone
    with client(c) as http:
        deadline = time.monotonic() + 10
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        while (r := send_piece(http, "p", "rank0", t0, rows0)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.json().get("complete") is False, r.text
        assert send_piece(http, "p", "rank1", t1, rows1).json()["complete"] is True
        assert put(http, 0, "q", deltas(c, 2)).json()["accepted"] is True
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["state"] in ("closed", "committing")
        record = http.get("/v1/status").json()["recent_rounds"][0]
        assert sorted(s["participant_id"] for s in record["submissions"]) == ["p", "q"]


def test_the_pieces_of_an_update_hold_no_more_bytes_than_the_update_sent_whole(tmp_path: Path) -> None:
    cfg = tiny_config(model=MODEL, max_upload_mb=2.5)  # the update is 1.7 MB
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        key = http.post("/v1/join", json={"name": "p"}).json()["participant_key"]
        http.post("/v1/join", json={"name": "q"})
        body, digest = whole_piece(c)
        both = [start_piece(c, "p", label, body, digest, key) for label in ("all", "again")]
        try:  # the first in streams; the other is refused from its headers
            (status, headers, answer), = answers(both, enough=1).values()
            assert status == 429 and answer["error"]["code"] == "pieces_in_flight", answer
            assert "max_upload_mb" in answer["error"]["message"] and answer["error"]["details"]["limit_bytes"] > 0
            assert headers["retry-after"] == "1"
        finally:
            for sock in both:
                sock.close()
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        deadline = time.monotonic() + 10
        while (r := send_piece(http, "p", "rank0", t0, rows0)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.json().get("complete") is False, r.text
        # half the update is in: a piece as large as the whole update would hold 1.5 updates
        sock = start_piece(c, "p", "all", body, digest, key)
        (status, _, answer), = answers([sock], enough=1).values()
        sock.close()
        assert status == 413 and answer["error"]["code"] == "pieces_too_large", answer
        assert send_piece(http, "p", "rank1", t1, rows1).json()["complete"] is True
        assert c.service.inspect().submitted == {"p": 100}


def test_the_pieces_in_flight_are_one_per_rank_within_bounds() -> None:
    assert pieces.in_flight_cap(None) == pieces.MIN_PIECES_IN_FLIGHT  # one process may send a few at once
    assert pieces.in_flight_cap(16) == 16
    assert pieces.in_flight_cap(1 << 20) == pieces.MAX_PIECES_IN_FLIGHT  # a world size is a claim
    room = pieces.room_for_piece("u", "x", 10, held=0, pieces_in=0, in_flight=dict.fromkeys("abcd", 10), ranks=2,
                                 limit=1000, header=0)
    assert room is not None and (room.status, room.code) == (429, "pieces_in_flight")
    assert pieces.room_for_piece("u", "x", 10, 0, 0, dict.fromkeys("abc", 10), ranks=2, limit=1000, header=0) is None
    # 995 held in 3 pieces and 10 more: within 1,000 and 2 header bytes a piece (1,008), not within 1 (1,004)
    assert pieces.room_for_piece("u", "x", 10, 995, 3, {}, ranks=2, limit=1000, header=2) is None
    room = pieces.room_for_piece("u", "x", 10, 995, 3, {}, ranks=2, limit=1000, header=1)
    assert room is not None and (room.status, room.code) == (413, "pieces_too_large")
