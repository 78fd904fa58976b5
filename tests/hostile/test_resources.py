"""What one hostile client can make the coordinator hold (issue 30, items 5, 6 and 7): stalled
downloads of rows, a stream subscriber that never reads beside large metric reports, and a
flood of idle connections from one address. Each measures what is held (RSS, bytes queued,
connections left open) and that the run goes on for everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members.roster import MAX_METRIC_VALUES
from fedtrain.coordinator.state.broadcast import BATCH_BYTES, Broadcaster
from fedtrain.transport.server_limits import ServerLimits
from fedtrain.wire import write_file
from tests.helpers.config import PTOKEN, tiny_config

WAIT_S = 30.0  # the most any step may take before the test calls it stuck (never reached when it passes)
AUTH = {"Authorization": f"Bearer {PTOKEN}"}


@contextlib.contextmanager
def coordinator(tmp_path: Path, limits: ServerLimits | None = None, init: Path | None = None,
                fast_io: bool = True) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(), init_weights=init, limits=limits,
                               fast_io=fast_io) as c:
        yield c


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status here")


def connect(c: BackgroundCoordinator, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    """A connection to `c` from the loopback address `source` (127.0.0.2 etc. are this host too)."""
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(WAIT_S)
    s.connect((c.host, c.port))
    return s


def request(method: str, path: str, extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer {PTOKEN}\r\n{extra}\r\n".encode()


def status_of(s: socket.socket) -> int:
    """The status of the next response on `s` (its head read, the body left)."""
    data = b""
    while b"\r\n" not in data:
        more = s.recv(4096)
        assert more, f"closed before an answer: {data!r}"
        data += more
    return int(data.split(b" ", 2)[1])


def open_by_server(socks: list[socket.socket]) -> int:
    """How many of `socks` the server has not closed (no EOF or reset waiting on them)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1 << 16):  # an answer: still open (b"": closed)
                n += 1
        except BlockingIOError:  # nothing to read: open
            n += 1
        except OSError:  # reset: closed
            pass
        finally:
            s.setblocking(True)
    return n


# -- item 5: rows downloads --------------------------------------------------------------------


ROWS = 4_000_000  # 16 MB of float32: far more than the socket buffers of a stalled client


@pytest.fixture
def model_16mb(tmp_path: Path) -> Path:
    path = tmp_path / "init.safetensors"
    write_file(path, {"w": torch.randn(ROWS, generator=torch.Generator().manual_seed(0))})
    return path


@pytest.mark.parametrize("fast_io", [True, False], ids=["fast", "plain"])
def test_stalled_rows_downloads_hold_no_copy_of_their_rows(tmp_path: Path, model_16mb: Path, fast_io: bool) -> None:
    """12 stalled downloads of all rows of version 0 used to hold 12 private copies (+192 MB)."""
    n = 12
    path = f"/v1/model?version=0&rows={quote(json.dumps({'w': [0, ROWS]}))}"
    with coordinator(tmp_path, ServerLimits(send_timeout_s=300), init=model_16mb, fast_io=fast_io) as c:
        whole = httpx.get(f"{c.url}{path}", headers=AUTH, timeout=WAIT_S)  # warm: every path of it has run once
        assert whole.status_code == 200 and len(whole.content) == int(whole.headers["content-length"])
        before = rss()
        stalled = []
        try:
            for _ in range(n):
                s = connect(c, rcvbuf=1 << 16)
                s.sendall(request("GET", path))
                assert status_of(s) == 200
                stalled.append(s)
            time.sleep(0.5)  # the senders fill the socket buffers, then wait
            grown = rss() - before
            # ... and the run goes on: a whole download completes beside them, the same bytes
            again = httpx.get(f"{c.url}{path}", headers=AUTH, timeout=WAIT_S)
            assert again.content == whole.content
        finally:
            for s in stalled:
                s.close()
    assert grown < 3 * ROWS * 4, f"{grown / 2**20:.0f} MB held by {n} stalled downloads of 16 MB each"


# -- item 6: the stream beside large metric reports ------------------------------------------


def test_a_subscriber_queue_is_bounded_in_bytes_and_sent_in_pieces() -> None:
    event = {"values": "x" * 100_000}  # ~100 kB each

    async def deaf_one() -> tuple[int, bool]:
        hub = Broadcaster(maxsize=1000, maxbytes=1 << 20)  # 1 MiB holds ten of them
        deaf = hub.subscribe()
        most = 0
        for _ in range(50):
            hub.publish("metrics", event)
            most = max(most, deaf.pending_bytes)
        return most, deaf.closed

    async def slow_one() -> list[int]:
        hub = Broadcaster(maxsize=1000, maxbytes=8 << 20)
        reader = hub.subscribe()
        for _ in range(50):  # 5 MB queued before it reads
            hub.publish("metrics", event)
        sizes = []
        async for text in reader.events(60.0, dict):
            sizes.append(len(text))
            if reader.pending == 0:
                break
        return sizes

    most, dropped = asyncio.run(deaf_one())
    assert dropped and most <= 1 << 20  # the deaf one held at most its bytes, then was dropped
    sizes = asyncio.run(slow_one())
    assert sum(sizes) > 5_000_000 and max(sizes) <= max(BATCH_BYTES, 100_100)  # never the whole queue at once


def test_a_deaf_subscriber_beside_large_metric_reports_is_dropped_within_its_bytes(tmp_path: Path) -> None:
    with coordinator(tmp_path) as c:
        r = httpx.post(f"{c.url}/v1/join", json={"name": "a"}, headers=AUTH)
        headers = {**AUTH, "X-Fedtrain-Participant-Key": r.json()["participant_key"]}
        deaf = connect(c, rcvbuf=1 << 12)
        deaf.sendall(request("GET", "/v1/stream"))
        deadline = time.monotonic() + WAIT_S
        while c.service.broadcast.count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = rss()
        values = {f"metric-{i}": float(i) for i in range(MAX_METRIC_VALUES)}  # ~40 kB per event
        with deaf, httpx.Client(base_url=c.url, headers=headers, timeout=WAIT_S) as http:
            for _ in range(150):  # 6 MB of events: more than one subscriber may hold (4 MiB), fewer than 1000
                assert http.post("/v1/participants/a/metrics", json={"values": values}).status_code == 200
                if c.service.broadcast.count == 0:
                    break
            grown = rss() - before
            assert c.service.broadcast.count == 0  # dropped: it reconnects, and its hello brings it up to date
            big = {f"m{i}": 1.0 for i in range(MAX_METRIC_VALUES + 1)}
            r = http.post("/v1/participants/a/metrics", json={"values": big})
            assert r.status_code == 413 and r.json()["error"]["details"]["field"] == "values"
            assert http.get("/v1/status").status_code == 200  # the run goes on
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MB held beside one deaf subscriber"


# -- item 7: connections -----------------------------------------------------------------------


def flood(c: BackgroundCoordinator, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """`n` idle connections from `source`, each with part of a request's head sent."""
    socks = []
    for _ in range(n):
        s = connect(c, source)
        with contextlib.suppress(OSError):  # closed by the server already: still counted
            s.sendall(b"GET /v1/healthz HTTP/1.1\r\n")
        socks.append(s)
    time.sleep(0.3)  # the server has seen them all
    return socks


def healthz(c: BackgroundCoordinator, source: str) -> int:
    with connect(c, source) as s:
        s.sendall(request("GET", "/v1/healthz"))
        return status_of(s)


@pytest.mark.parametrize("fast_io", [True, False], ids=["fast", "plain"])
def test_a_flood_of_idle_connections_from_one_address_locks_no_one_out(tmp_path: Path, fast_io: bool) -> None:
    limits = ServerLimits(max_connections=40, max_connections_per_address=10)
    with coordinator(tmp_path, limits, fast_io=fast_io) as c:
        socks = flood(c, 60)
        try:
            assert healthz(c, "127.0.0.2") == 200  # another address is served at once
            assert open_by_server(socks) <= 10  # the flood holds its address's share, no more
            if fast_io:  # the flooding address too: its oldest idle connection makes room
                assert healthz(c, "127.0.0.1") == 200
        finally:
            for s in socks:
                s.close()


def test_idle_connections_make_room_oldest_first_at_the_global_cap(tmp_path: Path) -> None:
    limits = ServerLimits(max_connections=12, max_connections_per_address=4)
    with coordinator(tmp_path, limits) as c:
        socks = [s for i in range(3) for s in flood(c, 4, f"127.0.0.{i + 2}")]  # 12: the cap, all idle
        try:
            assert healthz(c, "127.0.0.9") == 200
            assert open_by_server(socks[:1]) == 0 and open_by_server(socks[1:]) == 11  # the oldest went
        finally:
            for s in socks:
                s.close()


def test_a_full_address_with_every_connection_in_a_request_is_refused_clearly(tmp_path: Path) -> None:
    limits = ServerLimits(max_connections_per_address=3)
    with coordinator(tmp_path, limits) as c:
        busy = [connect(c) for _ in range(3)]
        for s in busy:  # each in a request: its body is awaited
            s.sendall(request("POST", "/v1/join", "content-type: application/json\r\ncontent-length: 100\r\n"))
        time.sleep(0.2)
        try:
            with connect(c) as s:
                s.sendall(request("GET", "/v1/healthz"))
                data = b""
                while more := s.recv(4096):
                    data += more
                head, body = data.split(b"\r\n\r\n", 1)
                assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
            assert healthz(c, "127.0.0.2") == 200
        finally:
            for s in busy:
                s.close()
