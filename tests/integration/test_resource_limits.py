"""What one client can hold of a coordinator on loopback (issue #18, items 8 and 9): stalled
downloads, idle connections, parallel uploads, subscribers that never read, and refusals
answered from the headers. Raw sockets, so that what the client sends and reads is the test's."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.http.limits import ServerLimits
from fedtrain.wire import DIGEST_HEADER, EncodedBody, write_file
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

WAIT_S = 30.0  # the most any step may take before the test calls it stuck (never reached when it passes)


@contextlib.contextmanager
def coordinator(tmp_path: Path, limits: ServerLimits | None = None, init: Path | None = None,
                **config: Any) -> Iterator[BackgroundCoordinator]:
    # The limits are the fast protocol's to enforce (with fast IO off only uvicorn's hold).
    with BackgroundCoordinator(tmp_path / "state", tiny_config(**config), init_weights=init, limits=limits,
                               fast_io=True) as c:
        yield c


KEYS: dict[str, str] = {}  # participant id -> the participant key of its join answer


def join(c: BackgroundCoordinator, name: str) -> str:
    r = httpx.post(f"{c.url}/v1/join", json={"name": name}, headers={"Authorization": f"Bearer {PTOKEN}"})
    KEYS[r.json()["participant_id"]] = r.json()["participant_key"]
    return r.json()["participant_id"]


def as_(pid: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {PTOKEN}", "X-Fedtrain-Participant-Key": KEYS[pid]}


def connect(c: BackgroundCoordinator, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT_S)
    s.connect((c.host, c.port))
    return s


def request(method: str, path: str, extra: str = "", token: str | None = PTOKEN) -> bytes:
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    return f"{method} {path} HTTP/1.1\r\nhost: test\r\n{auth}{extra}\r\n".encode()


def answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the next response with a Content-Length; fails if none comes."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        assert more, f"closed before an answer: {data!r}"
        data += more
    top, rest = data.split(b"\r\n\r\n", 1)
    lines = top.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(rest) < int(headers.get("content-length", 0)):
        more = s.recv(65536)
        assert more
        rest += more
    return int(lines[0].split()[1]), headers, rest


def closed(s: socket.socket) -> bool:
    """Whether the server closes the connection (EOF or reset) before WAIT_S, reading what comes."""
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def upload_head(pid: str, round_: int, length: int | None, tokens: int = 10, extra: str = "") -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    key = f"x-fedtrain-participant-key: {KEYS[pid]}\r\n" if pid in KEYS else ""
    return request("PUT", f"/v1/rounds/{round_}/updates/{pid}?tokens={tokens}",
                   f"{DIGEST_HEADER}: sha256:{'0' * 64}\r\n{size}{key}{extra}")


# -- item 8: downloads -------------------------------------------------------------------------


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    path = tmp_path / "init.safetensors"
    write_file(path, {"w": torch.randn(2_000_000)})  # 8 MB: more than the socket buffers of a stalled client
    return path


def stall_downloads(c: BackgroundCoordinator, n: int, token: str = PTOKEN) -> list[socket.socket]:
    """`n` downloads whose clients read their first bytes, then nothing more."""
    stalled = []
    for _ in range(n):
        s = connect(c, rcvbuf=1 << 16)
        s.sendall(request("GET", "/v1/model", token=token))
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        stalled.append(s)
    return stalled


def test_a_download_beside_70_stalled_ones_completes(tmp_path: Path, big_model: Path) -> None:
    with coordinator(tmp_path, ServerLimits(send_timeout_s=300), init=big_model) as c:
        # More than there are send threads. The admin's: one participant (or token) may have at
        # most MAX_DOWNLOAD_CONNECTIONS downloads in flight (tests/hostile/test_ranges.py).
        stalled = stall_downloads(c, 70, token=ATOKEN)
        try:
            r = httpx.get(f"{c.url}/v1/model", headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=WAIT_S)
            assert r.status_code == 200 and len(r.content) == int(r.headers["content-length"])
            for s in stalled:  # all still there, stalled: nothing timed out to make room
                s.settimeout(0.01)
                with pytest.raises(TimeoutError):
                    while s.recv(1 << 20):
                        pass
        finally:
            for s in stalled:
                s.close()


def test_a_stalled_download_times_out_and_its_connection_is_closed(tmp_path: Path, big_model: Path) -> None:
    with coordinator(tmp_path, ServerLimits(send_timeout_s=0.5), init=big_model) as c:
        (s,) = stall_downloads(c, 1)
        with s:
            time.sleep(1.5)  # past the send timeout, still reading nothing
            assert closed(s)


# -- item 8: connections -----------------------------------------------------------------------


def test_a_connection_that_sends_no_request_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    with coordinator(tmp_path, ServerLimits(idle_timeout_s=0.3)) as c:
        with connect(c) as silent, connect(c) as slow:
            slow.sendall(b"GET /v1/healthz HTTP/1.1\r\nhost: te")  # a head that never ends
            assert closed(silent) and closed(slow)
        with connect(c) as s:  # a request within the timeout is served, and so is the next on that connection
            for _ in range(2):
                s.sendall(request("GET", "/v1/healthz"))
                assert answer(s)[0] == 200
            assert closed(s)  # then idle again: closed


def test_a_connection_beyond_the_cap_is_answered_503_and_closed(tmp_path: Path) -> None:
    """When every connection is in a request (an idle one would be closed to make room instead:
    tests/hostile/test_resources.py)."""
    with coordinator(tmp_path, ServerLimits(max_connections=4)) as c:
        busy = [connect(c) for _ in range(4)]
        for s in busy:  # each in a request: its body is awaited
            s.sendall(request("POST", "/v1/join", "content-type: application/json\r\ncontent-length: 100\r\n"))
        time.sleep(0.2)
        try:
            with connect(c) as s:
                s.sendall(request("GET", "/v1/healthz"))
                status, headers, body = answer(s)
                assert status == 503 and json.loads(body)["error"]["code"] == "over_capacity"
                assert headers["connection"] == "close" and closed(s)
        finally:
            for s in busy:
                s.close()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the server sees them go
            with connect(c) as s:
                s.sendall(request("GET", "/v1/healthz"))
                if answer(s)[0] == 200:
                    return
        pytest.fail("still over capacity after the idle connections closed")


def test_idle_connections_hold_no_read_buffer_of_their_own(tmp_path: Path) -> None:
    """2,000 idle sockets used to take 256 KiB each (846 MB RSS); now a few KiB each."""
    n = 300
    with coordinator(tmp_path) as c:
        with connect(c) as s:  # warm: the loop's one read buffer exists
            s.sendall(request("GET", "/v1/healthz"))
            answer(s)
        before = rss()
        idle = []
        try:
            for _ in range(n):
                s = connect(c)
                s.sendall(b"GET /v1/healthz HTTP/1.1\r\n")  # a read lands, the request is not complete
                idle.append(s)
            time.sleep(0.5)  # let the server read them all
            grown = rss() - before
        finally:
            for s in idle:
                s.close()
    assert grown < n * (64 << 10), f"{grown / n / 1024:.0f} KiB per idle connection"


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status here")


# -- item 8: uploads ---------------------------------------------------------------------------


def test_a_second_upload_for_the_same_round_takes_over_from_its_headers(tmp_path: Path) -> None:
    """A newer attempt of an upload (its client gave the older connection up) takes over at
    once: the older connection is closed, and the newer's body is asked for (issue #34: it used
    to be refused 429 until the older timed out, every retry writing its body into the refusal)."""
    with coordinator(tmp_path) as c:
        pid = join(c, "a")
        first = connect(c)
        try:
            first.sendall(upload_head(pid, 0, 1000) + b"\0" * 10)  # streaming, stalled
            time.sleep(0.2)
            with connect(c) as second:
                second.sendall(upload_head(pid, 0, 1000, extra="expect: 100-continue\r\n"))  # the head only
                assert second.recv(64).startswith(b"HTTP/1.1 100 Continue")
                assert closed(first)  # the older connection is closed, not left to hold the slot
            other = join(c, "b")  # another participant's upload is not held up
            with connect(c) as third:
                third.sendall(upload_head(other, 0, 1000, extra="expect: 100-continue\r\n"))
                assert third.recv(64).startswith(b"HTTP/1.1 100 Continue")
        finally:
            first.close()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the first gone, its slot is free: the next one's body is asked for
            with connect(c) as again:
                again.sendall(upload_head(pid, 0, 8, extra="expect: 100-continue\r\n"))
                if again.recv(64).startswith(b"HTTP/1.1 100 Continue"):
                    return
        pytest.fail("the slot of an upload whose client left was not given back")


def test_a_stalled_upload_body_times_out_and_gives_its_slot_back(tmp_path: Path) -> None:
    with coordinator(tmp_path, ServerLimits(body_timeout_s=0.3)) as c:
        pid = join(c, "a")
        with connect(c) as s:
            s.sendall(upload_head(pid, 0, 100_000) + b"\0" * 1000)
            assert closed(s)
        with connect(c) as s:
            s.sendall(upload_head(pid, 0, 8, extra="expect: 100-continue\r\n"))
            assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")


# -- item 8: subscribers -----------------------------------------------------------------------


def subscribe(c: BackgroundCoordinator, rcvbuf: int | None = None) -> socket.socket:
    s = connect(c, rcvbuf)
    s.sendall(request("GET", "/v1/stream"))
    data = b""
    while b"event: hello" not in data:
        data += s.recv(65536)
    return s


def test_the_status_is_built_once_per_change_whatever_the_number_of_subscribers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with coordinator(tmp_path) as c:
        subscribers = [subscribe(c) for _ in range(20)]
        try:
            builds, changes = [], []
            status, publish = c.service.status, c.service.broadcast.publish

            def counted_publish(kind: str, data: Any) -> None:
                changes.extend([1] if kind == "status" else [])
                publish(kind, data)

            monkeypatch.setattr(c.service, "status", lambda: builds.append(1) or status())
            monkeypatch.setattr(c.service.broadcast, "publish", counted_publish)
            join(c, "a")
            for s in subscribers:
                data = b""
                while b"event: status" not in data:
                    data += s.recv(65536)
            assert changes and len(builds) <= len(changes) < len(subscribers)
        finally:
            for s in subscribers:
                s.close()


def test_subscribers_that_never_read_are_dropped_while_one_that_reads_gets_every_change(tmp_path: Path) -> None:
    with coordinator(tmp_path) as c:
        c.service.broadcast.maxsize = 50  # events queued for one subscriber at most
        deaf = [subscribe(c, rcvbuf=1 << 12) for _ in range(10)]
        reader = subscribe(c)
        got = bytearray()
        reading = threading.Thread(target=lambda: [got.extend(b) for b in iter(lambda: reader.recv(1 << 16), b"")])
        reading.start()
        try:
            with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
                for i in range(400):  # each a status change and an event
                    assert http.post("/v1/join", json={"name": f"p{i % 4}"}).status_code == 200
                    if c.service.broadcast.count == 1:
                        break
            assert c.service.broadcast.count == 1  # the deaf ones dropped, never more than their queue behind
            deadline = time.monotonic() + WAIT_S
            while got.count(b"event: event") < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got.count(b"event: event") == i + 1 and b"event: status" in got  # every event, in order
        finally:
            reader.shutdown(socket.SHUT_RDWR)
            reading.join(WAIT_S)
            reader.close()
            for s in deaf:
                s.close()


def test_a_subscriber_that_never_reads_is_cut_off_and_the_run_goes_on(tmp_path: Path) -> None:
    with coordinator(tmp_path, ServerLimits(send_timeout_s=0.5)) as c:
        pid = join(c, "a")
        deaf = subscribe(c, rcvbuf=1 << 12)
        with deaf, httpx.Client(base_url=c.url, headers=as_(pid)) as http:
            values = {f"m{i}": float(i) for i in range(1000)}  # ~50 kB per event, as many as a report may hold
            deadline = time.monotonic() + WAIT_S
            while c.service.broadcast.count and time.monotonic() < deadline:
                assert http.post(f"/v1/participants/{pid}/metrics", json={"values": values}).status_code == 200
                time.sleep(0.05)
            assert c.service.broadcast.count == 0 and closed(deaf)


# -- item 9: refusals answered from the headers ------------------------------------------------


def refused(c: BackgroundCoordinator, pid: str) -> list[tuple[str, bytes, int]]:
    return [
        ("length 2**63", upload_head(pid, 0, 2**63), 413),
        ("over max_upload_mb", upload_head(pid, 0, 2_000_000), 413),
        ("zero tokens", upload_head(pid, 0, 1000, tokens=0), 400),
        ("negative tokens", upload_head(pid, 0, 1000, tokens=-1), 422),
        ("no length", upload_head(pid, 0, None), 411),
        ("closed round", upload_head(pid, 5, 1000), 409),
        ("no token", upload_head(pid, 0, 1000).replace(f"authorization: Bearer {PTOKEN}\r\n".encode(), b""), 401),
        ("control body too large", request("POST", "/v1/join", f"content-length: {2**40}\r\n"), 413),
    ]


@pytest.mark.parametrize("expect", [False, True])
def test_refusals_are_answered_from_the_headers_without_100_continue(tmp_path: Path, expect: bool) -> None:
    with coordinator(tmp_path, max_upload_mb=1.0) as c:
        pid = join(c, "a")
        for case, head, status in refused(c, pid):
            if expect:
                head = head[:-2] + b"expect: 100-continue\r\n\r\n"
            with connect(c) as s:
                s.sendall(head)  # and no byte of the body
                got, _, body = answer(s)
                assert (case, got) == (case, status), body
                if expect or "2**" in case:  # the body was not read, and will not come: closed
                    assert closed(s), case


def test_a_refused_upload_sent_whole_reads_its_answer_and_the_connection_goes_on(tmp_path: Path) -> None:
    with coordinator(tmp_path) as c:
        pid = join(c, "a")
        zeros = {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}
        body = b"".join(bytes(v) for v in EncodedBody(zeros))
        with connect(c) as s:
            for round_ in (5, 6):  # refused from the headers, the body dropped after the answer
                s.sendall(upload_head(pid, round_, len(body)) + body)
                assert answer(s)[0] == 409
            s.sendall(request("GET", "/v1/healthz"))
            assert answer(s)[0] == 200


def test_concurrent_refusals_do_not_wait_for_each_other(tmp_path: Path) -> None:
    """Many clients declaring huge bodies at once: each answered, none read."""
    with coordinator(tmp_path) as c:
        pid = join(c, "a")
        socks = [connect(c) for _ in range(20)]
        try:
            results: list[int] = []

            def ask(s: socket.socket) -> None:
                s.sendall(upload_head(pid, 9, 2**62))
                results.append(answer(s)[0])

            threads = [threading.Thread(target=ask, args=(s,)) for s in socks]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT_S)
            assert results == [409] * len(socks)
        finally:
            for s in socks:
                s.close()
