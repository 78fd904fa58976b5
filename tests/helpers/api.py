"""Speaking to a coordinator's HTTP API from a test: clients (one cookie jar per coordinator and
token), raw uploads and pieces of an update, a round closed or waited for, the coordinator's
visible state before and after a refused request, the metrics page."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar
from typing import Any

import httpx
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.http.prometheus import CONTENT_TYPE
from fedtrain.coordinator.intake.pieces import ROWS_META
from fedtrain.participant import CoordinatorClient
from fedtrain.wire import DIGEST_HEADER, EncodedBody, digest_bytes, read_tensors
from fedtrain.wire.compress import compress
from tests.helpers.config import PTOKEN

# One cookie jar per coordinator and token: the clients of a test that share a token are one
# participant process, which holds the participant keys its joins answered with (cookies:
# `auth.py`); another coordinator (another test) starts with an empty jar.
JARS: dict[tuple[str, str | None], CookieJar] = {}


def client(c: BackgroundCoordinator, token: str | None = PTOKEN) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    jar = JARS.setdefault((c.url, token), CookieJar())
    return httpx.Client(base_url=c.url, headers=headers, timeout=30, cookies=jar)


def zeros_like_model(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}


def put(
    http: httpx.Client,
    round_: int,
    pid: str,
    tensors: dict[str, torch.Tensor],
    tokens: int = 100,
    digest: str | None = None,
    body: bytes | None = None,
) -> httpx.Response:
    enc = EncodedBody(tensors)
    data = body if body is not None else b"".join(bytes(c) for c in enc)
    headers = {DIGEST_HEADER: digest or enc.digest()}
    return http.put(f"/v1/rounds/{round_}/updates/{pid}", params={"tokens": tokens}, content=data, headers=headers)


def commit_round_0(c: BackgroundCoordinator, http: httpx.Client, name: str = "a") -> None:
    """`name` uploads a small update for round 0 (admin's client: it acts for anyone); returns
    once version 1 is committed."""
    delta = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
    assert put(http, 0, name, delta).status_code == 200
    http.get("/v1/rounds/0", params={"wait": 10})
    deadline = time.monotonic() + 10
    while c.service.inspect().committed_version < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.service.inspect().committed_version == 1


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["status"] == status and err["message"]
    if code:
        assert err["code"] == code, err
    return err


def snapshot(c: BackgroundCoordinator) -> dict:
    s = c.service
    inside = s.inspect()
    return {
        "version": s.version,
        "submitted": dict(inside.submitted),
        "late": dict(inside.late),
        "acc_count": inside.sum_count,
        # What the sum holds: nothing (its memory is written over by the next upload), or values.
        "acc_sum": 0.0 if inside.sum_empty else sum(float(t.abs().sum()) for t in inside.sum_values.values()),
        "acc_empty": inside.sum_empty,
        "params": {n: t.clone() for n, t in inside.weights.items()},
        "participants": {p.id: (p.state, p.tokens, p.bytes_up) for p in inside.participants.values()},
        "submissions": len(s.store.submissions(s.version)),
        "spool": sorted(p.name for p in s.spool.rglob("*") if p.is_file()),
    }


def assert_unchanged(c: BackgroundCoordinator, before: dict) -> None:
    after = snapshot(c)
    for key in before:
        if key == "params":
            for n, t in before["params"].items():
                assert torch.equal(after["params"][n], t), n
        else:
            assert after[key] == before[key], key


@contextmanager
def leaves_run_unchanged(c: BackgroundCoordinator, token: str | None = PTOKEN) -> Iterator[httpx.Client]:
    """A client for requests that must leave the run as it was: the run's state is taken
    (`snapshot`) on entry and compared (`assert_unchanged`) once the block ends without error."""
    before = snapshot(c)
    with client(c, token) as http:
        yield http
    assert_unchanged(c, before)


def raw_body(header: bytes | dict, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def upload_raw(http: httpx.Client, body: bytes, pid: str = "a", round_: int = 0) -> httpx.Response:
    return http.put(
        f"/v1/rounds/{round_}/updates/{pid}",
        params={"tokens": 10},
        content=body,
        headers={DIGEST_HEADER: digest_bytes(body)},
    )


def send_piece(http: httpx.Client, pid: str, label: str, tensors: dict[str, torch.Tensor],
               rows: dict[str, list[int]] | None = None, tokens: int = 100, scheme: str = "none",
               round_: int = 0) -> httpx.Response:
    meta: dict[str, str] = {}
    if scheme != "none":
        tensors, meta = compress(tensors, scheme)
    if rows:
        meta[ROWS_META] = json.dumps(rows)
    enc = EncodedBody(tensors, meta)
    return http.put(f"/v1/rounds/{round_}/updates/{pid}", params={"tokens": tokens, "piece": label},
                    content=b"".join(bytes(c) for c in enc), headers={DIGEST_HEADER: enc.digest()})


def halves(delta: dict[str, torch.Tensor]) -> list[tuple[dict[str, torch.Tensor], dict[str, list[int]]]]:
    """Two pieces as two FSDP ranks would hold them: the first and second half of the rows of
    every tensor with two rows or more; the others whole, in the first."""
    first: dict[str, torch.Tensor] = {}
    second: dict[str, torch.Tensor] = {}
    rows0: dict[str, list[int]] = {}
    rows1: dict[str, list[int]] = {}
    for name, t in delta.items():
        n = t.shape[0] if t.dim() else 1
        if n < 2:
            first[name] = t
            continue
        cut = n // 2
        first[name], rows0[name] = t[:cut].contiguous(), [0, cut]
        second[name], rows1[name] = t[cut:].contiguous(), [cut, n]
    return [(first, rows0), (second, rows1)]


def deltas(c: BackgroundCoordinator, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in c.service.inspect().weights.items()}


def rand_like(c: BackgroundCoordinator, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in c.service.inspect().weights.items()}


def wait_round(http, r: int, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = http.get(f"/v1/rounds/{r}", params={"wait": 5}).json()
        if info["state"] == "closed":
            return info
    raise AssertionError(f"round {r} did not close: {info}")


def zero_update(model: dict[str, Any]) -> EncodedBody:
    return EncodedBody({n: torch.zeros(s["shape"]) for n, s in model.items()})


def close_round(client: CoordinatorClient, pids: list[str], round_: int, model: dict[str, Any]) -> None:
    for pid in pids:
        client.upload(round_, pid, zero_update(model), tokens=10)
    assert client.wait_round(round_, wait_s=10)["state"] in ("closed", "committing")


def delta(params: dict[str, torch.Tensor], who: int, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + who)
    return {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in params.items()}


def upload(http: httpx.Client, round_: int, pid: str, tensors: dict[str, torch.Tensor]) -> httpx.Response:
    body = EncodedBody(tensors)
    return http.put(
        f"/v1/rounds/{round_}/updates/{pid}",
        params={"tokens": 10},
        content=b"".join(bytes(c) for c in body),
        headers={DIGEST_HEADER: body.digest()},
    )


def download(http: httpx.Client) -> tuple[int, dict[str, torch.Tensor]]:
    r = http.get("/v1/model")
    assert r.status_code == 200, r.text
    return int(r.headers["X-Fedtrain-Version"]), dict(
        read_tensors([r.content], expected_digest=r.headers[DIGEST_HEADER])
    )


def metrics(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in r.text.splitlines() if not line.startswith("#"))}
