"""Round numbers from a hostile participant: a negative or absurd round (or version) in a path
or a query is a 422 naming the field, never a 200, and never an update counted twice; every
number and string the API takes has declared bounds in the OpenAPI document."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import assert_error, assert_unchanged, client, put, snapshot, zeros_like_model
from tests.helpers.config import ATOKEN, tiny_config

MAX_ROUND = 2**53 - 1
MAX_TOKEN_CLAIM = 2**62  # a claim counts as at most the round's schedule before it is summed (policy.count_tokens)


def test_a_negative_round_is_refused_and_the_update_is_not_counted_twice(tmp_path: Path) -> None:
    cfg = tiny_config(late_uploads="fold", max_staleness=2)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for name in "ab":
            assert http.post("/v1/join", json={"name": name}).status_code == 200
        delta = zeros_like_model(c)
        assert put(http, 0, "a", delta).json()["accepted"] is True
        before = snapshot(c)
        for round_ in (-1, -2, MAX_ROUND + 1):
            err = assert_error(put(http, round_, "a", delta), 422, "invalid_request")
            assert "round_" in err["message"], err
        assert_unchanged(c, before)
        assert c.service.inspect().submitted == {"a": 100} and c.service.inspect().late == {}
        # the run goes on: b's update closes the round with a's once
        assert put(http, 0, "b", delta).json()["accepted"] is True
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["state"] in ("closed", "committing")
        record = http.get("/v1/status").json()["recent_rounds"][0]
        assert sorted(s["participant_id"] for s in record["submissions"]) == ["a", "b"]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path_factory.mktemp("rounds") / "s", tiny_config()) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/rounds/-1", "/v1/rounds/-1e23", "/v1/rounds/1e23",
                                  f"/v1/rounds/{MAX_ROUND + 1}", "/v1/rounds/99999999999999999999999"])
def test_a_round_status_of_no_possible_round_is_a_422(coordinator: BackgroundCoordinator, path: str) -> None:
    with client(coordinator, ATOKEN) as http:
        err = assert_error(http.get(path), 422, "invalid_request")
        assert "round_" in err["message"]
        assert http.get(f"/v1/rounds/{MAX_ROUND}").status_code == 409  # the largest: not open, but a round
        assert http.get("/v1/rounds/0").status_code == 200


@pytest.mark.parametrize(("path", "params", "field"), [
    ("/v1/model", {"version": -1}, "version"),
    ("/v1/model", {"version": MAX_ROUND + 1}, "version"),
    ("/v1/config", {"round": MAX_ROUND + 1}, "round"),
    ("/v1/rounds/0", {"participant_id": "x" * 65}, "participant_id"),
    ("/v1/rounds/0", {"piece": "p" * 65}, "piece"),
    ("/v1/metrics", {"name": "m" * 257}, "name"),
])
def test_query_numbers_and_strings_out_of_bounds_are_a_422_naming_the_field(
        coordinator: BackgroundCoordinator, path: str, params: dict, field: str) -> None:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    err = assert_error(get_raw(coordinator, f"{path}?{query}"), 422, "invalid_request")
    assert field in err["message"], err


def get_raw(c: BackgroundCoordinator, target: str) -> httpx.Response:
    """GET `target` as given, not normalized by a client."""
    host, port = c.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", target, headers={"Authorization": f"Bearer {ATOKEN}"})
        answer = conn.getresponse()
        return httpx.Response(answer.status, content=answer.read())
    finally:
        conn.close()


def _parameters(spec: dict) -> list[tuple[str, str, dict]]:
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", []):
                out.append((f"{method.upper()} {path} {p['in']}.{p['name']}", p["in"], p["schema"]))
    return out


def _leaves(schema: dict) -> list[dict]:
    return [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]


def test_every_path_and_query_parameter_has_declared_bounds(coordinator: BackgroundCoordinator) -> None:
    """By construction: a number without minimum and maximum, or a string without maxLength, in
    the OpenAPI document is a hole the next surface would ship with."""
    spec = httpx.get(f"{coordinator.url}/v1/openapi.json").json()
    params = _parameters(spec)
    assert len(params) >= 15
    unbounded = []
    for where, _, schema in params:
        for leaf in _leaves(schema):
            kind = leaf.get("type")
            if kind in ("integer", "number"):
                if ("minimum" not in leaf and "exclusiveMinimum" not in leaf) or "maximum" not in leaf:
                    unbounded.append(where)
                elif kind == "integer" and leaf["maximum"] > (MAX_TOKEN_CLAIM if where.endswith(".tokens")
                                                               else MAX_ROUND):
                    unbounded.append(f"{where} (maximum above 2^53)")
            elif kind == "string" and "maxLength" not in leaf and "enum" not in leaf:
                unbounded.append(where)
            elif kind not in ("integer", "number", "string", "boolean"):
                unbounded.append(f"{where} ({kind})")
    assert not unbounded, f"parameters without declared bounds: {unbounded}"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/admin/rollback", {"version": False}, "version"),  # lax pydantic took false for version 0
    ("/v1/admin/rollback", {"version": "0"}, "version"),
    ("/v1/config/validate", {"changes": {}, "extra": 1}, "extra"),
    ("/v1/join", {"name": "x" * 65}, "name"),
    ("/v1/join", {"name": "bad name!"}, "name"),
])
def test_body_fields_out_of_bounds_are_a_422_naming_the_field(coordinator: BackgroundCoordinator, path: str,
                                                               body: dict, field: str) -> None:
    with client(coordinator, ATOKEN) as http:
        err = assert_error(http.post(path, json=body), 422, "invalid_request")
        assert field in err["message"], err


def test_heartbeat_numbers_are_json_numbers(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator, ATOKEN) as http:
        assert http.post("/v1/join", json={"name": "h"}).status_code == 200
        for body, field in (({"round": True}, "round"), ({"step": "3"}, "step"), ({"config_version": 2**53}, "config")):
            err = assert_error(http.post("/v1/participants/h/heartbeat", json=body), 422, "invalid_request")
            assert field in err["message"], err
        assert http.post("/v1/participants/h/heartbeat", json={"round": 0, "step": 3, "loss": 1}).status_code == 200


def test_every_integer_and_string_of_a_request_body_has_declared_bounds(coordinator: BackgroundCoordinator) -> None:
    spec = httpx.get(f"{coordinator.url}/v1/openapi.json").json()
    schemas = spec["components"]["schemas"]
    bodies = [name for name in schemas if name.endswith("Request") or name == "ConfigChange"]
    assert len(bodies) >= 6, bodies
    unbounded = []
    for model in bodies:
        for field, schema in schemas[model]["properties"].items():
            for leaf in _leaves(schema):
                kind = leaf.get("type")
                number = kind == "integer" and ("minimum" not in leaf or leaf.get("maximum", MAX_ROUND + 1) > MAX_ROUND)
                if number or (kind == "string" and "maxLength" not in leaf):
                    unbounded.append(f"{model}.{field}")
    assert not unbounded, f"body fields without declared bounds: {unbounded}"
