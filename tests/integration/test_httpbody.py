"""The HTTP protocol whose request bodies are read straight into the app's memory
(`fedtrain.transport.readinto`),
served by uvicorn over loopback and driven by a raw socket, so that keep-alive, pauses
and pipelining are under the test's control."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.requests import ClientDisconnect

from fedtrain.coordinator.http.server import bind
from fedtrain.transport import versions
from fedtrain.transport.http_server import fast_protocol
from fedtrain.transport.protocols import READINTO, SEND, Abandoned
from fedtrain.transport.readinto import ReadIntoProtocol
from fedtrain.transport.server_limits import ServerLimits

# xdist: one server (module fixture) for the module
pytestmark = pytest.mark.xdist_group("httpbody")

events: list[str] = []


async def _json(send: Any, status: int, doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    query = dict(p.split("=") for p in scope["query_string"].decode().split("&") if p)
    source = scope.get("extensions", {}).get(READINTO)
    path = scope["path"]
    if path == "/thread":  # work on asyncio's default thread pool, as spool writes, folds and commits are
        await asyncio.wait_for(asyncio.to_thread(time.sleep, 0.01), 5)
        await _json(send, 200, {})
        return
    if path == "/send":  # a response body written by a worker thread straight to the socket
        data = memoryview(payload(int(query["n"])))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(data)).encode())]})
        try:
            run = scope["extensions"][SEND].run(lambda out: out.sendall(data))
            if "timeout" in query:
                try:
                    await asyncio.wait_for(run, float(query["timeout"]))
                except asyncio.TimeoutError:
                    events.append("send: cancelled")
                    return
            else:
                await run
        except ClientDisconnect:
            events.append("send: disconnect")
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        events.append("send: done")
        return
    if path == "/receive":  # the stock way, on the same connection
        data = bytearray()
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        await _json(send, 200, {"sha": hashlib.sha256(data).hexdigest(), "n": len(data), "port": scope["client"][1]})
        return
    if source is None:
        await _json(send, 200, {"extension": False})
        return
    piece = int(query.get("piece", 65536))
    if path == "/read":
        data, buf = bytearray(), memoryview(bytearray(piece))
        while n := await source.readinto(buf):
            data += buf[:n]
            if n < piece:
                assert await source.readinto(buf) == 0  # the end, and it stays the end
                break
        await _json(send, 200, {"sha": hashlib.sha256(data).hexdigest(), "n": len(data), "port": scope["client"][1]})
    elif path == "/partial":  # answers before reading the body to its end
        buf = memoryview(bytearray(int(query["n"])))
        got = await source.readinto(buf)
        await _json(send, 200, {"got": got, "head": bytes(buf[:8]).hex()})
    elif path == "/abandon":  # a read stopped from elsewhere, then the rest drained, as a round close does
        buf = memoryview(bytearray(int(query["size"])))
        asyncio.get_running_loop().call_later(0.2, source.abandon)
        try:
            await source.readinto(buf)
            outcome = "read"
        except Abandoned:
            outcome = "abandoned"
        before = bytes(buf)
        await asyncio.sleep(0.3)  # the client sends the rest meanwhile: none of it may land in buf
        untouched = bytes(buf) == before
        scratch = memoryview(bytearray(1 << 16))
        while await source.readinto(scratch) == len(scratch):
            pass
        await _json(send, 409, {"outcome": outcome, "untouched": untouched})
    elif path == "/timeout":  # a read cancelled half way: its memory is given up at once
        buf = memoryview(bytearray(int(query["size"])))
        try:
            await asyncio.wait_for(source.readinto(buf), 0.2)
        except asyncio.TimeoutError:
            before = bytes(buf)
            await asyncio.sleep(0.3)
            await _json(send, 408, {"untouched": bytes(buf) == before})
    elif path == "/disconnect":
        buf = memoryview(bytearray(int(query["size"])))
        try:
            await source.readinto(buf)
        except ClientDisconnect:
            events.append("disconnect")
            return
        events.append("read")
        await _json(send, 200, {})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(app, http=ReadIntoProtocol, lifespan="off", log_level="warning", loop="auto")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    yield sock.getsockname()[1]
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


def head(path: str, length: int | None, extra: bytes = b"") -> bytes:
    sized = b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n"
    return b"PUT " + path.encode() + b" HTTP/1.1\r\nhost: test\r\n" + sized + extra + b"\r\n"


def response(s: socket.socket) -> tuple[int, dict[str, Any], bytes]:
    """(status, JSON body, bytes after it) of one response; fails on a closed connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        assert more, "the connection closed before a response"
        data += more
    top, rest = data.split(b"\r\n\r\n", 1)
    lines = top.split(b"\r\n")
    status = int(lines[0].split()[1])
    fields = dict(line.split(b":", 1) for line in lines[1:])
    length = int(next(v for k, v in fields.items() if k.strip().lower() == b"content-length"))
    while len(rest) < length:
        more = s.recv(65536)
        assert more
        rest += more
    return status, json.loads(rest[:length]), rest[length:]


def payload(n: int) -> bytes:
    return (bytes(range(256)) * 7 + b"fedtrain") * (n // 1800) + bytes(n % 1800)


@pytest.mark.parametrize("size,piece", [(0, 1024), (10, 3), (300_000, 4096), (2_000_001, 1 << 20), (1 << 20, 1 << 20)])
def test_a_body_read_in_place_is_the_body_and_the_connection_serves_the_next_request(
        server: int, size: int, piece: int) -> None:
    body = payload(size)
    with socket.create_connection(("127.0.0.1", server)) as s:
        for _ in range(2):  # twice on one connection: the parser is in step after a body read past it
            s.sendall(head(f"/read?piece={piece}", size))
            for i in range(0, size, 100_000):
                s.sendall(body[i : i + 100_000])
            status, doc, extra = response(s)
            assert status == 200 and extra == b""
            assert doc["n"] == size and doc["sha"] == hashlib.sha256(body).hexdigest()
        s.sendall(head("/receive", 5) + b"hello")  # and a stock read after it
        status, doc, _ = response(s)
        assert doc["sha"] == hashlib.sha256(b"hello").hexdigest()


def test_a_body_answered_before_it_was_read_whole_is_dropped_and_the_connection_goes_on(server: int) -> None:
    body = payload(3_000_000)
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head("/partial?n=1000000", len(body)))
        s.sendall(body)
        status, doc, _ = response(s)
        assert status == 200 and doc == {"got": 1_000_000, "head": body[:8].hex()}
        s.sendall(head("/read", 6) + b"second")
        status, doc, extra = response(s)
        assert doc["n"] == 6 and doc["sha"] == hashlib.sha256(b"second").hexdigest() and extra == b""


def test_an_abandoned_read_writes_nothing_more_and_the_client_gets_the_answer(server: int) -> None:
    body = payload(1_500_000)
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head(f"/abandon?size={len(body)}", len(body)))
        s.sendall(body[:400_000])
        time.sleep(0.3)  # the server abandons its read meanwhile
        s.sendall(body[400_000:])
        status, doc, _ = response(s)
        assert status == 409 and doc == {"outcome": "abandoned", "untouched": True}
        s.sendall(head("/read", 4) + b"next")
        assert response(s)[1]["n"] == 4


def test_a_client_gone_mid_body_is_a_client_disconnect(server: int) -> None:
    events.clear()
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head("/disconnect?size=1000000", 1_000_000) + payload(300_000))
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["disconnect"]


def test_a_chunked_body_has_no_in_place_read_and_is_served_the_stock_way(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head("/read", None) + b"5\r\nhello\r\n0\r\n\r\n")
        status, doc, _ = response(s)
        assert status == 200 and doc == {"extension": False}
        s.sendall(head("/receive", None) + b"5\r\nhello\r\n0\r\n\r\n")
        assert response(s)[1]["n"] == 5


def test_a_cancelled_read_gives_its_memory_up_and_the_connection_closes_after_the_answer(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head("/timeout?size=1000000", 1_000_000) + payload(300_000))
        time.sleep(0.3)
        s.sendall(payload(200_000))  # more body after the cancel: it must not land in the buffer
        status, doc, _ = response(s)
        assert status == 408 and doc == {"untouched": True}
        s.settimeout(10)
        rest = b""
        try:
            while more := s.recv(65536):  # the body could not be put back in step: closed
                rest += more
        except ConnectionResetError:  # closed with body bytes unread: a reset, not a FIN
            pass
        assert rest == b""


def raw_response(s: socket.socket, n: int) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    top, body = data.split(b"\r\n\r\n", 1)
    assert top.startswith(b"HTTP/1.1 200") and b"content-length: %d" % n in top
    while len(body) < n:
        body += s.recv(1 << 20)
    return body


def test_a_response_sent_from_a_worker_thread_arrives_whole_and_the_connection_goes_on(server: int) -> None:
    events.clear()
    with socket.create_connection(("127.0.0.1", server)) as s:
        for n in (0, 10, 5_000_000):
            s.sendall(b"GET /send?n=%d HTTP/1.1\r\nhost: test\r\n\r\n" % n)
            assert raw_response(s, n) == payload(n)
        s.sendall(head("/read", 2) + b"ok")
        assert response(s)[1]["n"] == 2
    assert events == ["send: done"] * 3


def test_a_client_gone_mid_response_is_a_client_disconnect_and_the_server_goes_on(server: int) -> None:
    events.clear()
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(b"GET /send?n=50000000 HTTP/1.1\r\nhost: test\r\n\r\n")
        s.recv(1 << 16)
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["send: disconnect"]
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /send?n=1000 HTTP/1.1\r\nhost: test\r\n\r\n")
        assert raw_response(s, 1000) == payload(1000)


def test_a_cancelled_send_closes_the_connection_and_the_server_goes_on(server: int) -> None:
    events.clear()
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(b"GET /send?n=50000000&timeout=0.3 HTTP/1.1\r\nhost: test\r\n\r\n")  # and never read
        deadline = time.monotonic() + 10
        while "send: cancelled" not in events and time.monotonic() < deadline:
            time.sleep(0.01)  # (the last test's final "send: done" may land here too)
        assert "send: cancelled" in events
        s.settimeout(10)
        got = 0
        with contextlib.suppress(ConnectionResetError):  # closed under the unread response
            while more := s.recv(1 << 20):
                got += len(more)
        assert got < 50_000_000  # cut short, never left hanging
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /send?n=1000 HTTP/1.1\r\nhost: test\r\n\r\n")
        assert raw_response(s, 1000) == payload(1000)


@pytest.mark.parametrize("name, version", [("uvicorn", "0.55.0"), ("uvicorn", "0.53.1"), ("httptools", "0.10.0"),
                                           ("httptools", None)])
def test_the_coordinator_falls_back_to_the_stock_protocol_outside_the_tested_versions(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str, version: str | None) -> None:
    limits = ServerLimits()
    ours = fast_protocol(limits, fast_io=True)  # the uvicorn and httptools installed here
    assert ours is not None and ours.func is ReadIntoProtocol  # type: ignore[attr-defined]
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda dist: version if dist == name else real(dist))
    assert fast_protocol(limits, fast_io=True) is None
    assert fast_protocol(limits, fast_io=True) is None
    warned = [r for r in caplog.records if "outside the range" in r.getMessage() and name in r.getMessage()]
    assert len(warned) == 1  # once, however often the server is built


def test_stalled_downloads_do_not_hold_up_the_default_thread_pool(server: int) -> None:
    events.clear()
    stalled = []
    try:
        for _ in range(min(32, (os.cpu_count() or 1) + 4) + 2):  # more than asyncio's default pool has threads
            s = socket.create_connection(("127.0.0.1", server))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            s.sendall(b"GET /send?n=50000000 HTTP/1.1\r\nhost: test\r\n\r\n")  # and never read
            stalled.append(s)
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", server)) as s:
            s.settimeout(20)
            s.sendall(b"GET /thread HTTP/1.1\r\nhost: test\r\n\r\n")
            assert response(s)[0] == 200
    finally:
        for s in stalled:
            s.close()
