"""Hardening (issue #18, items 10, 12, 13, 14) through a real coordinator on loopback: a deeply
nested header is a 400, a damaged outer state file stops a restart, non-finite or unworkable
config numbers are refused live, and a revoked token in `?token=` is `token_revoked`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator, Tokens
from fedtrain.errors import StateError
from tests.helpers.api import assert_error, client, leaves_run_unchanged, put, raw_body, upload_raw, zeros_like_model
from tests.helpers.config import ATOKEN, tiny_config


@pytest.mark.parametrize("depth", [20, 100_000])
def test_a_deeply_nested_header_is_a_400_and_changes_nothing(coord: BackgroundCoordinator, depth: int) -> None:
    header = b'{"__metadata__": ' + b"[" * depth + b"]" * depth + b"}"
    with leaves_run_unchanged(coord) as http:
        err = assert_error(upload_raw(http, raw_body(header)), 400, "invalid_body")
        assert "nests arrays or objects" in err["message"]
        assert http.get("/v1/status").status_code == 200  # and the coordinator still answers


def test_a_flipped_byte_in_the_outer_state_stops_the_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config()) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
            assert put(http, 0, "a", zeros_like_model(c)).status_code == 200
            assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
        path = c.service.inspect().checkpoints.outer_path(1)
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + 5] ^= 0x40  # a momentum value: finite, but wrong
    path.write_bytes(bytes(raw))
    with pytest.raises(StateError) as info:
        BackgroundCoordinator(state, tiny_config())
    assert "outer-000001.safetensors is damaged on disk" in info.value.message


def _put_raw(http: httpx.Client, text: str) -> httpx.Response:
    # raw JSON: a client's encoder may refuse Infinity, Python's decoder (the server's) takes it
    return http.put("/v1/config", content=text.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ('{"round_timeout_s": Infinity}', "round_timeout_s", "finite number"),
        ('{"round_timeout_s": 1e999}', "round_timeout_s", "finite number"),  # JSON's way to Infinity
        ('{"outer": {"lr": Infinity}}', "outer.lr", "finite number"),
        ('{"train": {"lr": NaN}}', "train.lr", "finite number"),
        ('{"max_upload_mb": 1e-9}', "max_upload_mb", "greater than or equal to 0.01"),
    ],
)
def test_a_live_change_to_a_number_that_cannot_work_is_refused(
    coordinator: BackgroundCoordinator, changes: str, field: str, reason: str
) -> None:
    with client(coordinator, ATOKEN) as http:
        before = http.get("/v1/config").json()
        err = assert_error(_put_raw(http, f'{{"changes": {changes}}}'), 422, "invalid_config")
        assert f"{field}: " in err["message"] and reason in err["message"], err
        dry = http.post("/v1/config/validate", content=f'{{"changes": {changes}}}'.encode(),
                        headers={"Content-Type": "application/json"}).json()
        assert dry["valid"] is False and field in dry["error"]
        after = http.get("/v1/config").json()
        assert after == before and after["latest_version"] == 1  # nothing stored, nothing shown as null


def test_a_revoked_token_in_the_query_is_token_revoked(tmp_path: Path) -> None:
    tokens = Tokens(["tok-a", "tok-b"], ATOKEN)
    with BackgroundCoordinator(tmp_path / "state", tiny_config(), tokens=tokens) as c:
        with client(c, "tok-a") as a, client(c, ATOKEN) as admin:
            a.post("/v1/join", json={"name": "alice"})
            admin.post("/v1/admin/tokens/revoke", json={"participant_id": "alice"}).raise_for_status()
            header = a.get("/v1/stream")
            assert_error(header, 401, "token_revoked")
        with httpx.Client(base_url=c.url, timeout=30) as anon:
            query = anon.get("/v1/stream", params={"token": "tok-a"})
            err = assert_error(query, 401, "token_revoked")
            assert err == header.json()["error"]  # both ways a token arrives answer the same
            assert_error(anon.get("/v1/stream", params={"token": "nope"}), 401, "unauthorized")
            with anon.stream("GET", "/v1/stream", params={"token": "tok-b"}) as ok:
                assert ok.status_code == 200
