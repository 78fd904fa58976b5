"""Hostile requests to the compressed download (`GET /v1/model/delta?from=`): every parameter
out of bounds or of the wrong kind is a clear 4xx, never a traceback; `from` other than the
version before the newest is 409 delta_unavailable, a run without compressed downloads 404
no_delta; byte ranges behave as on the whole model. What a participant gains by lying about
the version it holds: a delta that does not check against the version's digest, so it
downloads the model whole; nothing changes on the coordinator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.engine.served import ServedModel
from fedtrain.wire import DIGEST_HEADER, read_tensors
from fedtrain.wire.delta import apply_delta, info_of, target_body
from tests.helpers.api import client, commit_round_0
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

MODEL_DIGEST = "X-Fedtrain-Model-Digest"


def _tensors(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    meta: dict[str, str] = {}
    return dict(read_tensors(iter([body]), on_header=lambda _s, m: meta.update(m))), meta


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackgroundCoordinator, httpx.Client, bytes]]:
    """A run with int8 downloads whose round 0 is committed: version 1 has a delta from 0."""
    cfg = tiny_config(rounds=0, train={"download_compression": "int8"})
    with BackgroundCoordinator(tmp_path_factory.mktemp("s"), cfg) as c, client(c, ATOKEN) as admin:
        v0 = admin.get("/v1/model").content
        with client(c) as http:
            assert http.post("/v1/join", json={"name": "a"}).status_code == 200
        commit_round_0(c, admin)
        yield c, admin, v0


@pytest.mark.parametrize("params", [{}, {"from": -1}, {"from": 2**53}, {"from": "x"}, {"from": "1.5"},
                                    {"from": ""}, {"from": "0", "participant_id": "bad id!"},
                                    {"from": "0", "participant_id": "x" * 65}])
def test_bad_parameters_are_a_clear_422(run, params: dict) -> None:  # type: ignore[no-untyped-def]
    _, admin, _ = run
    r = admin.get("/v1/model/delta", params=params)
    assert r.status_code == 422, (params, r.text[:200])
    assert r.json()["error"]["message"]


@pytest.mark.parametrize("from_", [1, 2, 5, 2**53 - 1])
def test_a_from_other_than_the_version_before_is_409(run, from_: int) -> None:  # type: ignore[no-untyped-def]
    _, admin, _ = run
    r = admin.get("/v1/model/delta", params={"from": from_})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "delta_unavailable" and error["details"] == {"version": 1, "from": from_}


def test_the_delta_leads_to_the_served_model(run) -> None:  # type: ignore[no-untyped-def]
    _, admin, v0 = run
    r = admin.get("/v1/model/delta", params={"from": 0})
    assert r.status_code == 200, r.text
    whole = admin.get("/v1/model")
    assert r.headers["x-fedtrain-version"] == "1" and r.headers[MODEL_DIGEST] == whole.headers[DIGEST_HEADER]
    assert r.headers["etag"] == f'"{r.headers[DIGEST_HEADER]}"' and len(r.content) < len(whole.content) / 3
    tensors, meta = _tensors(r.content)
    info = info_of(meta)
    new = apply_delta(_tensors(v0)[0], tensors, meta)
    assert target_body(new, info).digest() == whole.headers[DIGEST_HEADER]
    served = _tensors(whole.content)[0]
    assert all(torch.equal(new[n], served[n]) for n in served)


def test_ranges_resume_the_delta_like_the_model(run) -> None:  # type: ignore[no-untyped-def]
    _, admin, _ = run
    whole = admin.get("/v1/model/delta", params={"from": 0})
    etag, body = whole.headers["etag"], whole.content
    rest = admin.get("/v1/model/delta", params={"from": 0}, headers={"Range": "bytes=100-", "If-Range": etag})
    assert rest.status_code == 206 and rest.content == body[100:]
    assert rest.headers["content-range"] == f"bytes 100-{len(body) - 1}/{len(body)}"
    stale = admin.get("/v1/model/delta", params={"from": 0}, headers={"Range": "bytes=100-", "If-Range": '"x"'})
    assert stale.status_code == 200 and stale.content == body
    for header, status in [({"Range": "bytes=0-1,4-5"}, 416), ({"Range": f"bytes={len(body)}-"}, 416),
                           ({"If-Match": '"another"'}, 412), ({"Range": "bytes=" + "9" * 300}, 422)]:
        r = admin.get("/v1/model/delta", params={"from": 0}, headers=header)
        assert r.status_code == status, (header, r.text[:200])
        assert r.json()["error"]["message"]


def test_who_may_ask(run) -> None:  # type: ignore[no-untyped-def]
    c, _, _ = run
    assert httpx.get(f"{c.url}/v1/model/delta", params={"from": 0}).status_code == 401
    with client(c) as http:  # as a participant: itself only
        assert http.get("/v1/model/delta", params={"from": 0, "participant_id": "a"}).status_code == 200
        other = http.get("/v1/model/delta", params={"from": 0, "participant_id": "nobody"})
        assert 400 <= other.status_code < 500 and other.json()["error"]["code"]


def test_a_participant_that_lies_about_its_version_downloads_whole(run) -> None:  # type: ignore[no-untyped-def]
    c, _, v0 = run
    before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    with CoordinatorClient(c.url, PTOKEN) as http:
        pid = http.join("liar")["participant_id"]
        held = ServedModel()
        held.tensors, held.version = {n: t + 1e-3 for n, t in _tensors(v0)[0].items()}, 0  # not version 0's bits
        assert held.take_delta(http, pid, None, None) is None  # does not check: the caller downloads whole
        assert held.version is None and not held.tensors
        honest = ServedModel()
        honest.tensors, honest.version = _tensors(v0)[0], 0
        got = honest.take_delta(http, pid, None, None)
        assert got is not None and got[0] == 1 and honest.deltas_taken == 1
        claims_newest = ServedModel()
        claims_newest.tensors, claims_newest.version = _tensors(v0)[0], 1  # a version with no delta from it
        assert claims_newest.take_delta(http, pid, None, None) is None
    after = c.service.inspect().weights
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_a_run_that_sends_models_whole_has_no_delta(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c, ATOKEN) as admin:
        r = admin.get("/v1/model/delta", params={"from": 0})
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_delta"
