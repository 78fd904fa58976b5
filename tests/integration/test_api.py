"""The coordinator's HTTP API against a real server on loopback: auth, errors, uploads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import DIGEST_HEADER, EncodedBody, read_tensors
from tests.helpers.api import assert_error, client, put, zeros_like_model
from tests.helpers.config import ATOKEN


def test_health_openapi_and_error_shape(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator, None) as http:
        assert http.get("/v1/healthz").json()["ok"] is True
        spec = http.get("/v1/openapi.json").json()
        assert "/v1/join" in spec["paths"] and "/v1/rounds/{round_}/updates/{pid}" in spec["paths"]
        assert_error(http.get("/v1/nowhere"), 404, "not_found")
        assert_error(http.get("/v1/status"), 401, "unauthorized")
    with client(coordinator, "wrong") as http:
        err = assert_error(http.post("/v1/join", json={"name": "x"}), 401)
        assert "wrong" not in err["message"]  # tokens are never echoed


def test_join_returns_config_round_and_model(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator) as http:
        j = http.post("/v1/join", json={"name": "alice"}).json()
        assert j["participant_id"] == "alice" and j["current_round"] == 0
        assert j["config"]["train"]["sync_every"] == 5
        assert set(j["model"]) == set(coordinator.service.inspect().weights)
        assert "body.name" in assert_error(http.post("/v1/join", json={"name": "bad name!"}), 422)["message"]
        assert_error(http.post("/v1/join", json={"nam": "x"}), 422, "invalid_request")
        r = http.get("/v1/model")
        tensors = dict(read_tensors([r.content], expected_digest=r.headers[DIGEST_HEADER]))
        for n, t in coordinator.service.inspect().weights.items():
            assert torch.equal(tensors[n], t)


def test_upload_idempotent_and_late_upload_409(coordinator: BackgroundCoordinator) -> None:
    svc = coordinator.service
    with client(coordinator) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        zeros = zeros_like_model(coordinator)
        assert put(http, 0, "a", zeros).json() == {"accepted": True, "duplicate": False, "round": 0}
        assert put(http, 0, "a", zeros).json()["duplicate"] is True
        assert svc.inspect().sum_count == 1
        assert put(http, 0, "b", zeros).json()["accepted"] is True
        info = http.get("/v1/rounds/0", params={"wait": 10, "participant_id": "a"}).json()
        assert info["state"] in ("committing", "closed") and info["current_round"] == 1  # merged
        err = assert_error(put(http, 0, "a", zeros), 409, "round_closed")
        assert err["details"]["current_round"] == 1
        assert_error(put(http, 5, "a", zeros), 409, "round_closed")
        assert_error(http.get("/v1/rounds/7"), 409, "round_not_open")


@pytest.mark.parametrize(
    "case",
    [
        "flipped",
        "truncated",
        "nan",
        "shape",
        "missing_key",
        "dtype",
        "no_digest",
        "garbage",
        "unknown_participant",
        "zero_tokens",
    ],
)
def test_bad_upload_refused_and_state_unchanged(coordinator: BackgroundCoordinator, case: str) -> None:
    svc = coordinator.service
    with client(coordinator) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        good = zeros_like_model(coordinator)
        name0 = next(iter(good))
        params_before = {n: t.clone() for n, t in svc.inspect().weights.items()}
        enc = EncodedBody(good)
        raw = b"".join(bytes(c) for c in enc)
        if case == "flipped":
            bad = bytearray(raw)
            bad[-3] ^= 0xFF
            r = put(http, 0, "a", good, body=bytes(bad), digest=enc.digest())
            assert_error(r, 400)
        elif case == "truncated":
            r = put(http, 0, "a", good, body=raw[: len(raw) // 2], digest=enc.digest())
            assert_error(r, 400)
        elif case == "nan":
            t = dict(good)
            t[name0] = torch.full_like(t[name0], float("nan"))
            assert_error(put(http, 0, "a", t), 422, "non_finite")
        elif case == "shape":
            t = dict(good)
            t[name0] = torch.zeros(3, 3)
            err = assert_error(put(http, 0, "a", t), 422)
            assert name0 in err["message"]
        elif case == "missing_key":
            t = dict(good)
            del t[name0]
            err = assert_error(put(http, 0, "a", t), 422)
            assert name0 in err["message"]
        elif case == "dtype":
            t = dict(good)
            t[name0] = t[name0].double()
            err = assert_error(put(http, 0, "a", t), 422)
            assert name0 in err["message"]
        elif case == "no_digest":
            r = http.put("/v1/rounds/0/updates/a", params={"tokens": 5}, content=raw)
            assert_error(r, 400, "digest_required")
        elif case == "garbage":
            assert_error(put(http, 0, "a", good, body=b"not a safetensors body at all", digest=enc.digest()), 400)
        elif case == "unknown_participant":
            assert_error(put(http, 0, "mallory", good), 404, "unknown_participant")
        elif case == "zero_tokens":
            assert_error(put(http, 0, "a", good, tokens=0), 400, "invalid_tokens")
        assert svc.version == 0 and svc.inspect().submitted == {} and svc.inspect().sum_count == 0
        assert svc.inspect().sum_empty  # the sum holds nothing: the next upload writes over it
        for n, t in svc.inspect().weights.items():
            assert torch.equal(t, params_before[n])
        # the run still works: both participants upload and the round closes
        assert put(http, 0, "a", good).status_code == 200
        assert put(http, 0, "b", good).status_code == 200
        assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"


def test_participant_bound_to_its_token(tmp_path) -> None:
    from fedtrain.coordinator import Tokens
    from tests.helpers.config import tiny_config

    tokens = Tokens(["tok-a", "tok-b"], ATOKEN)
    with BackgroundCoordinator(tmp_path, tiny_config(), tokens=tokens) as c:
        with client(c, "tok-a") as a, client(c, "tok-b") as b, client(c, ATOKEN) as admin:
            a.post("/v1/join", json={"name": "alice"})
            assert_error(b.post("/v1/participants/alice/heartbeat", json={}), 403, "forbidden")
            assert_error(b.post("/v1/join", json={"name": "alice"}), 409, "name_taken")
            assert admin.get("/v1/status").status_code == 200


def test_compressed_upload_must_match_its_declared_scheme(coordinator: BackgroundCoordinator) -> None:
    from fedtrain.wire.compress import compress

    svc = coordinator.service
    with client(coordinator) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})  # keeps the round open after a's upload
        zeros = zeros_like_model(coordinator)
        # declares int8 but sends fp32 tensors
        enc = EncodedBody(zeros, {"fedtrain.compression": "int8"})
        r = http.put("/v1/rounds/0/updates/a", params={"tokens": 5}, content=b"".join(bytes(c) for c in enc),
                     headers={DIGEST_HEADER: enc.digest()})
        err = assert_error(r, 422)
        assert "::scale" in err["message"]
        enc = EncodedBody(zeros, {"fedtrain.compression": "zip"})
        r = http.put("/v1/rounds/0/updates/a", params={"tokens": 5}, content=b"".join(bytes(c) for c in enc),
                     headers={DIGEST_HEADER: enc.digest()})
        assert "unknown compression" in assert_error(r, 400)["message"]
        assert svc.inspect().sum_count == 0 and svc.inspect().submitted == {}
        tensors, meta = compress({n: t + 0.5 for n, t in zeros.items()}, "int8")
        enc = EncodedBody(tensors, meta)
        r = http.put("/v1/rounds/0/updates/a", params={"tokens": 5}, content=b"".join(bytes(c) for c in enc),
                     headers={DIGEST_HEADER: enc.digest()})
        assert r.status_code == 200, r.text
        # decoded and folded: the first contribution as it is (its weight, 5 tokens, is the sum's scale)
        assert svc.inspect().sum_count == 1 and svc.inspect().sum_weight == 5
        assert all(torch.allclose(t, torch.full_like(t, 0.5)) for t in svc.inspect().sum_values.values())


def test_a_lone_participants_upload_goes_straight_into_the_sum_with_the_same_result(tmp_path: Path) -> None:
    """One participant: its upload is copied from the socket into the running sum (no spool
    file); the new global model is bit for bit what the spooled path gives."""
    from tests.helpers.config import tiny_config

    g = torch.Generator().manual_seed(3)
    delta = None
    results = {}
    for mode, cfg in (("direct", tiny_config()), ("spooled", tiny_config(late_uploads="fold"))):
        with BackgroundCoordinator(tmp_path / mode, cfg) as c, client(c) as http:
            http.post("/v1/join", json={"name": "solo"})
            if delta is None:
                delta = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in c.service.inspect().weights.items()}
            assert put(http, 0, "solo", delta, tokens=7).json()["accepted"]
            path = c.service.last_receive_path()
            assert path is not None and path.path == ("direct" if mode == "direct" else "spool")
            assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
            if mode == "direct":
                assert not [p for p in c.service.spool.rglob("*") if p.is_file()]
            results[mode] = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    for n in results["direct"]:
        assert torch.equal(results["direct"][n], results["spooled"][n]), n
