"""Bad input on every route: a 4xx in the one JSON error shape, and the run's state untouched.

Complements test_api.py's bad-upload cases with malformed safetensors headers, wrong
dtypes and keys, Inf, body size limits, huge numbers, NaN in JSON, wrong rounds and
unknown participants on every route that names one.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.api import assert_error, client, leaves_run_unchanged, put, raw_body, upload_raw, zeros_like_model
from tests.helpers.config import BOTH_TRANSPORTS

pytestmark = BOTH_TRANSPORTS


def _first(c: BackgroundCoordinator) -> tuple[str, torch.Tensor]:
    return next(iter(zeros_like_model(c).items()))


MALFORMED = {
    "huge_header_length": lambda c: struct.pack("<Q", 2**62) + b"{}",
    "zero_header_length": lambda c: struct.pack("<Q", 0) + b"xxxx",
    "header_not_json": lambda c: raw_body(b"{not json at all"),
    "header_not_object": lambda c: raw_body(b"[1, 2, 3]"),
    "header_duplicate_key": lambda c: raw_body(
        b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
        b' "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4,
    ),
    "header_offsets_gap": lambda c: raw_body({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "header_unknown_dtype": lambda c: raw_body({"x": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}),
    "header_negative_shape": lambda c: raw_body({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}),
    "only_prefix": lambda c: struct.pack("<Q", 100),
    "empty": lambda c: b"",
    "trailing_bytes": lambda c: b"".join(bytes(x) for x in EncodedBody(zeros_like_model(c))) + b"extra",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_safetensors_is_refused(coord: BackgroundCoordinator, case: str) -> None:
    with leaves_run_unchanged(coord) as http:
        err = assert_error(upload_raw(http, MALFORMED[case](coord)), 400)
        assert err["code"] in ("invalid_body", "invalid_update"), err


def _tensors(c: BackgroundCoordinator, case: str) -> dict[str, torch.Tensor]:
    t = zeros_like_model(c)
    name, first = _first(c)
    if case == "int_dtype":
        t[name] = first.long()
    elif case == "bf16_without_scheme":
        t[name] = first.bfloat16()
    elif case == "extra_key":
        t["surprise.weight"] = torch.zeros(2)
    elif case == "renamed_key":
        t["renamed"] = t.pop(name)
    elif case == "scalar_shape":
        t[name] = torch.zeros(())
    elif case == "inf":
        t[name] = first.clone()
        t[name].view(-1)[0] = float("inf")
    elif case == "neg_inf_last_tensor":
        last = list(t)[-1]
        t[last] = torch.full_like(t[last], float("-inf"))
    return t


@pytest.mark.parametrize(
    "case,status",
    [
        ("int_dtype", 422),
        ("bf16_without_scheme", 422),
        ("extra_key", 422),
        ("renamed_key", 422),
        ("scalar_shape", 422),
        ("inf", 422),
        ("neg_inf_last_tensor", 422),
    ],
)
def test_wrong_tensors_are_refused(coord: BackgroundCoordinator, case: str, status: int) -> None:
    with leaves_run_unchanged(coord) as http:
        err = assert_error(put(http, 0, "a", _tensors(coord, case)), status)
    assert err["message"]


def test_body_size_limits(coord: BackgroundCoordinator) -> None:
    with leaves_run_unchanged(coord) as http:
        big = {"name": "x", "info": {"pad": "y" * (2 << 20)}}
        assert_error(http.post("/v1/join", json=big), 413, "too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused as it grows
            yield b'{"name": "x", "info": {"pad": "'
            for _ in range(40):
                yield b"z" * 65536
            yield b'"}}'

        assert_error(http.post("/v1/join", content=chunks(), headers={"content-type": "application/json"}), 413)
        assert_error(http.put("/v1/config", content=b"{" + b" " * (2 << 20) + b"}"), 413)
        # uploads: refused by Content-Length against max_upload_mb (1 MB here) before a byte is read
        r = http.put(
            "/v1/rounds/0/updates/a",
            params={"tokens": 5},
            content=b"\0" * 1_100_000,
            headers={DIGEST_HEADER: "sha256:" + "0" * 64},
        )
        assert_error(r, 413, "too_large")
    assert "x" not in coord.service.inspect().participants


def test_json_fields_validated(coord: BackgroundCoordinator) -> None:
    with leaves_run_unchanged(coord) as http:
        for body in (
            b'{"loss": NaN}',
            b'{"tokens_per_s": Infinity}',
            b'{"step": -1}',
            b'{"step": 1e400}',
            b'{"round": 18446744073709551616}',
            b'{"colour": "red"}',
            b"not json",
            b"[]",
        ):
            r = http.post("/v1/participants/a/heartbeat", content=body, headers={"content-type": "application/json"})
            assert_error(r, 422)
        big = 2**70
        assert_error(http.post("/v1/participants/a/metrics", json={"step": big, "values": {"x": 1.0}}), 422)
        assert_error(http.post("/v1/participants/a/metrics", json={"values": {"x": "high"}}), 422)
        r = http.post(
            "/v1/participants/a/metrics",
            content=b'{"values": {"x": NaN}}',
            headers={"content-type": "application/json"},
        )
        assert_error(r, 422)
        assert_error(put(http, 0, "a", zeros_like_model(coord), tokens=big), 422)
        assert "body.name" in assert_error(http.post("/v1/join", json={"name": "x" * 65}), 422)["message"]
        assert_error(http.post("/v1/join", json={"name": 7}), 422)
        assert_error(http.get("/v1/rounds/0", params={"wait": 61}), 422)
        assert_error(http.get("/v1/rounds/zero"), 422)
        assert_error(http.get("/v1/model", params={"version": -1}), 422)
        assert_error(http.get("/v1/model", params={"version": 99}), 404, "version_not_kept")
    assert coord.service.inspect().live["a"].loss is None


def test_wrong_round_and_unknown_participant_on_every_route(coord: BackgroundCoordinator) -> None:
    zeros = zeros_like_model(coord)
    with leaves_run_unchanged(coord) as http:
        assert_error(put(http, 1, "a", zeros), 409, "round_closed")
        assert_error(put(http, -1, "a", zeros), 422, "invalid_request")  # no round is below 0
        assert_error(http.get("/v1/rounds/3"), 409, "round_not_open")
        for method, path, body in [
            ("POST", "/v1/participants/ghost/heartbeat", {}),
            ("POST", "/v1/participants/ghost/leave", None),
            ("POST", "/v1/participants/ghost/metrics", {"values": {"x": 1.0}}),
            ("GET", "/v1/rounds/0?participant_id=ghost", None),
        ]:
            assert_error(http.request(method, path, json=body), 404, "unknown_participant")
        assert_error(put(http, 0, "ghost", zeros), 404, "unknown_participant")
    assert "ghost" not in coord.service.inspect().participants
    with client(coord) as http:  # and the run still works
        assert put(http, 0, "a", zeros).status_code == 200
        assert put(http, 0, "b", zeros).status_code == 200
        assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
