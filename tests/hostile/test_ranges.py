"""Hostile Range / If-Range / If-Match headers on the model download: each gets a clear 4xx or
the whole body as RFC 9110 says, never a traceback, and at most one range per request; and
the downloads one participant may hold in flight are bounded."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.model.downloads import MAX_DOWNLOAD_CONNECTIONS, DownloadsInFlight
from fedtrain.errors import Refused
from fedtrain.transport.ranges import MAX_RANGE_CHARS
from fedtrain.wire import write_file
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

REFUSED = [  # (Range, the error code of its 416)
    ("bytes=0-1,5-9", "too_many_ranges"),
    ("bytes=0-1," + ",".join(f"{i}-{i}" for i in range(2, 20)), "too_many_ranges"),
    ("bytes=0-0,0-0", "too_many_ranges"),
    ("bytes=abc-", "invalid_range"),
    ("bytes=1-x", "invalid_range"),
    ("bytes=-5-10", "invalid_range"),
    ("bytes=-", "invalid_range"),
    ("bytes=", "too_many_ranges"),  # no range at all
    ("bytes=10-5", "invalid_range"),
    ("bytes=1.5-2", "invalid_range"),
    ("bytes=0x10-", "invalid_range"),
    ("bytes= 1 - 2", "invalid_range"),
    ("bytes=" + "9" * 21 + "-", "invalid_range"),  # more digits than any int64 holds
    ("bytes=0-" + "9" * 40, "invalid_range"),
    ("bytes=99999999999999999999-", "range_not_satisfiable"),  # 20 digits: parsed, past the end
    ("bytes=-0", "range_not_satisfiable"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with BackgroundCoordinator(tmp_path_factory.mktemp("s"), tiny_config()) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        whole = http.get("/v1/model")
        assert whole.status_code == 200
        yield http, whole.content


@pytest.mark.parametrize("header, code", REFUSED)
def test_a_malformed_or_excessive_range_is_a_clear_416(served, header: str, code: str) -> None:  # type: ignore[no-untyped-def]
    http, body = served
    r = http.get("/v1/model", headers={"Range": header})
    assert r.status_code == 416, (header, r.text[:200])
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    assert r.headers["content-range"] == f"bytes */{len(body)}"


@pytest.mark.parametrize("header", ["items=0-5", "bits=0-1,2-3", "bytes0-5", "=0-5", ""])
def test_a_range_in_a_unit_other_than_bytes_is_ignored(served, header: str) -> None:  # type: ignore[no-untyped-def]
    http, body = served
    r = http.get("/v1/model", headers={"Range": header})
    assert r.status_code == 200 and r.content == body


@pytest.mark.parametrize("name", ["Range", "If-Range", "If-Match"])
def test_an_overlong_header_is_refused_unread(served, name: str) -> None:  # type: ignore[no-untyped-def]
    http, _ = served
    r = http.get("/v1/model", headers={name: "bytes=" + "1" * MAX_RANGE_CHARS})
    assert 400 <= r.status_code < 500 and "error" in r.json()


@pytest.mark.parametrize("if_match", ["*", '"nope", *', '"nope",*'])
def test_if_match_any_matches(served, if_match: str) -> None:  # type: ignore[no-untyped-def]
    http, body = served
    r = http.get("/v1/model", headers={"If-Match": if_match, "Range": "bytes=4-"})
    assert r.status_code == 206 and r.content == body[4:]


@pytest.mark.parametrize("if_match", ['"nope"', "", ",", "W/\"x\""])
def test_if_match_naming_another_body_is_412(served, if_match: str) -> None:  # type: ignore[no-untyped-def]
    http, _ = served
    r = http.get("/v1/model", headers={"If-Match": if_match})
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"


def test_a_participant_holds_a_bounded_number_of_downloads_in_flight() -> None:
    """However many connections (ranges, retries) a participant opens, at most
    MAX_DOWNLOAD_CONNECTIONS of its downloads are in flight; another participant is not held up."""
    book = DownloadsInFlight()
    held = [book.begin("p0", f'"e{i % 3}"', "download", 100) for i in range(MAX_DOWNLOAD_CONNECTIONS)]
    with pytest.raises(Refused) as info:
        book.begin("p0", '"e9"', "download", 100)
    assert info.value.status == 429 and info.value.code == "too_many_downloads"
    book.begin("p1", '"e0"', "download", 100).end()  # per participant, not per address
    held[0].end()
    held[0].end()  # ending twice frees one slot only
    book.begin("p0", '"e0"', "download", 100)
    with pytest.raises(Refused):
        book.begin("p0", '"e0"', "download", 100)
    assert sum(v["connections"] for v in book.views("p0")) == MAX_DOWNLOAD_CONNECTIONS


def test_downloads_that_name_no_participant_count_against_their_token(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Leaving participant_id out escapes no cap: 33 downloads held open by one participant token
    (each stalled: the client reads nothing) get 32 answers and one 429; once they close, a
    download goes through again."""
    path = tmp_path / "init.safetensors"
    write_file(path, {"w": torch.zeros(4 << 20)})  # 16 MB: more than a stalled connection's buffers take
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=path) as c:
        host, port = c.url.removeprefix("http://").split(":")
        socks = []
        for _ in range(MAX_DOWNLOAD_CONNECTIONS + 1):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server stalls soon
            s.connect((host, int(port)))
            s.sendall(f"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {PTOKEN}\r\n\r\n".encode())
            socks.append(s)
        try:
            heads = []
            for s in socks:
                s.settimeout(10)
                heads.append(s.recv(12))
            assert sorted(h[9:12] for h in heads) == [b"200"] * MAX_DOWNLOAD_CONNECTIONS + [b"429"]
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=30) as http:
            while (r := http.get("/v1/model")).status_code == 429 and time.monotonic() < deadline:
                time.sleep(0.1)
            size = c.service.inspect().checkpoints.global_path(0).stat().st_size
            assert r.status_code == 200 and len(r.content) == size
