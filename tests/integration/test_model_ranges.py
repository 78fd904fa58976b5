"""Byte ranges of the model download (RFC 9110 §14, `transport/ranges.py`), on both server paths
(fast IO: written to the socket from a worker thread; plain: a chunked StreamingResponse) and
for both sources (the published version from memory, a committed one from its file), whole
models and `rows=` slices alike: every range is exactly the bytes of the whole body there."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import DIGEST_HEADER
from tests.helpers.api import commit_round_0
from tests.helpers.config import ATOKEN, tiny_config


def ranges_to_try(size: int) -> list[tuple[str, int, int]]:
    """(Range header, first byte, stop) across the header, the data, the ends."""
    return [("bytes=0-0", 0, 1), ("bytes=0-7", 0, 8), (f"bytes=5-{size // 2}", 5, size // 2 + 1),
            (f"bytes={size // 3}-", size // 3, size), (f"bytes={size - 1}-", size - 1, size),
            ("bytes=-10", size - 10, size), (f"bytes=-{size * 4}", 0, size),
            (f"bytes=3-{size * 10}", 3, size), (f"bytes=17-{size * 10**12}", 17, size)]


def check_ranges(http: httpx.Client, params: dict[str, object]) -> None:
    whole = http.get("/v1/model", params=params)
    assert whole.status_code == 200, whole.text
    body, etag = whole.content, whole.headers["etag"]
    assert etag == f'"{whole.headers[DIGEST_HEADER]}"' and whole.headers["accept-ranges"] == "bytes"
    size = len(body)
    for header, start, stop in ranges_to_try(size):
        r = http.get("/v1/model", params=params, headers={"Range": header, "If-Range": etag})
        assert r.status_code == 206, (header, r.text)
        assert r.content == body[start:stop], header
        assert r.headers["content-range"] == f"bytes {start}-{stop - 1}/{size}", header
        assert int(r.headers["content-length"]) == stop - start
        assert r.headers["etag"] == etag
        r = http.get("/v1/model", params=params, headers={"Range": header})  # no If-Range: unconditional
        assert r.status_code == 206 and r.content == body[start:stop], header
    # a stale validator: the whole body, as it is now (RFC 9110 §13.1.5)
    for stale in ('"xxh3-128:00000000000000000000000000000000"', "Wed, 02 Dec 2026 10:00:00 GMT", "W/" + etag):
        r = http.get("/v1/model", params=params, headers={"Range": "bytes=10-", "If-Range": stale})
        assert r.status_code == 200 and r.content == body, stale
    # If-Match: the body if it is still this one, else 412
    r = http.get("/v1/model", params=params, headers={"Range": "bytes=10-", "If-Match": etag})
    assert r.status_code == 206 and r.content == body[10:]
    r = http.get("/v1/model", params=params, headers={"If-Match": '"sha256:' + "0" * 64 + '"'})
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"
    # past the end: 416, with the size
    for header in (f"bytes={size}-", f"bytes={size}-{size + 5}", f"bytes={10**19}-", "bytes=-0"):
        r = http.get("/v1/model", params=params, headers={"Range": header, "If-Range": etag})
        assert r.status_code == 416, header
        assert r.headers["content-range"] == f"bytes */{size}"
        assert r.json()["error"]["code"] == "range_not_satisfiable"


@pytest.mark.parametrize("fast_io", [True, False])
def test_ranges_of_every_body_are_its_bytes(tmp_path: Path, fast_io: bool) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=3), fast_io=fast_io) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        http.post("/v1/join", json={"name": "a"})
        name = next(iter(c.service.inspect().weights))
        rows = json.dumps({name: [1, 3]})
        for params in ({"version": 0}, {"version": 0, "rows": rows}):  # version 0: from its file
            check_ranges(http, params)
        commit_round_0(c, http)
        for params in ({}, {"version": 1}, {"version": 1, "rows": rows}):  # the published one: from memory
            check_ranges(http, params)
        # a slice has its own validator: the whole model's does not resume it
        whole = http.get("/v1/model", params={"version": 1})
        r = http.get("/v1/model", params={"version": 1, "rows": rows},
                     headers={"Range": "bytes=10-", "If-Range": whole.headers["etag"]})
        assert r.status_code == 200 and r.headers["etag"] != whole.headers["etag"]
