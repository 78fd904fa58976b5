"""API fuzzing with schemathesis against the coordinator's own OpenAPI schema: no 5xx, ever,
and every error in the one JSON error shape.

Every operation of /v1/openapi.json is called with generated valid and invalid inputs,
once with a participant token and once with the admin token, against a real coordinator
on loopback. The case count per operation is bounded (FEDTRAIN_FUZZ_EXAMPLES, default 40)
and generation is derandomized so that CI runs are reproducible; raise the count and set
FEDTRAIN_FUZZ_DERANDOMIZE=0 for a longer hunt.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

# xdist: one fuzz server (module fixture) for every case, and test_the_fuzzers_ran_cases counts what ran in this process
pytestmark = pytest.mark.xdist_group("fuzz")

EXAMPLES = int(os.environ.get("FEDTRAIN_FUZZ_EXAMPLES", "40"))
DERANDOMIZE = os.environ.get("FEDTRAIN_FUZZ_DERANDOMIZE", "1") != "0"
CASES: dict[str, int] = {PTOKEN: 0, ATOKEN: 0}  # cases run, per token


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCoordinator]:
    state: Path = tmp_path_factory.mktemp("fuzz") / "state"
    with BackgroundCoordinator(state, tiny_config(rounds=0, max_upload_mb=1.0)) as c:
        import httpx

        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
            assert http.post("/v1/join", json={"name": "fuzz"}).status_code == 200
        yield c


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server: BackgroundCoordinator):
    import httpx

    spec = httpx.get(f"{fuzz_server.url}/v1/openapi.json").json()
    streams = [
        p
        for p, ops in spec["paths"].items()
        for op in ops.values()
        if "text/event-stream" in str(op.get("responses", {}))
    ]
    for path in streams:  # an event stream never ends: it has its own tests
        del spec["paths"][path]
    return schemathesis.openapi.from_dict(spec)


schema = schemathesis.pytest.from_fixture("fuzz_schema")


def _shape_ok(body: object) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return isinstance(err, dict) and {"status", "code", "message", "details"} <= set(err) and bool(err["message"])


def check(case, token: str, server: BackgroundCoordinator) -> None:
    if case.query and "wait" in case.query:  # a long-poll would only make the fuzzer wait
        with contextlib.suppress(TypeError, ValueError):
            case.query["wait"] = min(float(case.query["wait"]), 0.2)
    if case.path_parameters and "pid" in case.path_parameters and random.random() < 0.5:
        case.path_parameters["pid"] = "fuzz"  # a real participant, to reach past the 404
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    CASES[token] += 1
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code >= 400 and case.formatted_path.startswith("/v1"):
        assert _shape_ok(response.json()), response.text


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@FUZZ
def test_no_server_errors_with_participant_token(case, fuzz_server: BackgroundCoordinator) -> None:
    check(case, PTOKEN, fuzz_server)


@schema.parametrize()
@FUZZ
def test_no_server_errors_with_admin_token(case, fuzz_server: BackgroundCoordinator) -> None:
    check(case, ATOKEN, fuzz_server)


def test_the_fuzzers_ran_cases() -> None:
    """A fuzz run that generated nothing (a plugin incompatibility, a schema that lost its
    routes) must not read as a pass: each token's run made at least a few cases per route."""
    ran = {"participant": CASES[PTOKEN], "admin": CASES[ATOKEN]}
    print(f"\nschemathesis: {ran['participant']} cases with the participant token, {ran['admin']} with the admin token")
    assert all(n >= 20 for n in ran.values()), f"the fuzz tests ran too few cases: {ran}"
