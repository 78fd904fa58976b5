"""API fuzzing with schemathesis against the coordinator's own OpenAPI schema, in three modes,
against a real coordinator on loopback:

- positive: every operation called with inputs its schema allows, with a participant token and
  with the admin token: never a 5xx, and every error in the one JSON error shape;
- negative: inputs that violate the schema (a number past its bound, a string too long, a
  missing field...): a 4xx, never a 5xx nor a 2xx (schemathesis' `negative_data_rejection`,
  which leaves out a violation that a URL or JSON encoding makes valid again);
- stateful: schemathesis walks the OpenAPI links of a participant's life (`routes/links.py`):
  join -> upload -> round status -> leave, the upload carrying a real (zero) update; no 5xx,
  and the whole walk happens.

The case count per operation is bounded (FEDTRAIN_FUZZ_EXAMPLES, default 24, split between
the positive and negative modes; 40 until 2026-12-03, cut for the default run's time) and
generation is derandomized so that CI runs are reproducible; raise the count and set
FEDTRAIN_FUZZ_DERANDOMIZE=0 for a longer hunt.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyStrategyDefinition
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import negative_data_rejection

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members.auth import KEY_HEADER
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

# xdist: one fuzz server (module fixture) for every case, and test_the_fuzzers_ran_cases counts what ran in this process
pytestmark = pytest.mark.xdist_group("fuzz")

EXAMPLES = int(os.environ.get("FEDTRAIN_FUZZ_EXAMPLES", "24"))
DERANDOMIZE = os.environ.get("FEDTRAIN_FUZZ_DERANDOMIZE", "1") != "0"
CASES: dict[str, int] = {"positive": 0, "negative": 0, "stateful": 0}  # cases run, per mode
WALKS: list[list[tuple[str, int]]] = []  # the stateful walks: (operation, status) per step
#: The server's own refusal of a request line over its limit (64 KiB), in plain text: the
#: request never reaches the API. Schemathesis reaches it with a 64 KiB `rows`, percent-encoded.
LINE_TOO_LONG = "Invalid HTTP request received."


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCoordinator]:
    state: Path = tmp_path_factory.mktemp("fuzz") / "state"
    with BackgroundCoordinator(state, tiny_config(rounds=0, max_upload_mb=1.0)) as c:
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
            assert http.post("/v1/join", json={"name": "fuzz"}).status_code == 200
        yield c


@pytest.fixture(scope="module")
def fuzz_spec(fuzz_server: BackgroundCoordinator) -> dict[str, Any]:
    spec = httpx.get(f"{fuzz_server.url}/v1/openapi.json").json()
    streams = [
        p
        for p, ops in spec["paths"].items()
        for op in ops.values()
        if "text/event-stream" in str(op.get("responses", {}))
    ]
    for path in streams:  # an event stream never ends: it has its own tests
        del spec["paths"][path]
    return spec


def _schema(spec: dict[str, Any], mode: str) -> Any:
    config = SchemathesisConfig.from_dict({
        "generation": {"mode": mode},
        "checks": {"negative_data_rejection": {"expected-statuses": ["4XX"]}},
    })
    return schemathesis.openapi.from_dict(spec, config=config)


@pytest.fixture(scope="module")
def positive_schema(fuzz_spec: dict[str, Any]) -> Any:
    return _schema(fuzz_spec, "positive")


@pytest.fixture(scope="module")
def negative_schema(fuzz_spec: dict[str, Any]) -> Any:
    """The operations that take something to violate (parameters or a body)."""
    paths: dict[str, Any] = {}
    for path, ops in fuzz_spec["paths"].items():
        taking = {m: op for m, op in ops.items() if op.get("parameters") or op.get("requestBody")}
        if taking:
            paths[path] = taking
    return _schema({**fuzz_spec, "paths": paths}, "negative")


positive = schemathesis.pytest.from_fixture("positive_schema")
negative = schemathesis.pytest.from_fixture("negative_schema")


def _shape_ok(body: object) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return isinstance(err, dict) and {"status", "code", "message", "details"} <= set(err) and bool(err["message"])


def call(case: Any, token: str, server: BackgroundCoordinator) -> Any:
    """Send `case` as the holder of `token`; its answer, checked: no 5xx, errors in the one shape."""
    if case.query and "wait" in case.query:  # a long-poll would only make the fuzzer wait
        with contextlib.suppress(TypeError, ValueError):
            case.query["wait"] = min(float(case.query["wait"]), 0.2)
    if case.path_parameters and "pid" in case.path_parameters and random.random() < 0.5:
        case.path_parameters["pid"] = "fuzz"  # a real participant, to reach past the 404
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    CASES[case.meta.generation.mode.value] += 1
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code >= 400 and case.formatted_path.startswith("/v1") and response.text != LINE_TOO_LONG:
        assert _shape_ok(response.json()), response.text
    return response


@pytest.fixture(scope="module")
def zero_update(fuzz_server: BackgroundCoordinator) -> tuple[bytes, str]:
    enc = EncodedBody({n: torch.zeros_like(t) for n, t in fuzz_server.service.inspect().weights.items()})
    return b"".join(bytes(x) for x in enc), enc.digest()


@pytest.fixture(scope="module")
def life_schema(fuzz_spec: dict[str, Any]) -> Any:
    """The operations of a participant's life, which the links join (the admin's would only 403)."""
    life = ("/v1/join", "/v1/participants/{pid}/heartbeat", "/v1/rounds/{round_}/updates/{pid}", "/v1/rounds/{round_}",
            "/v1/participants/{pid}/leave")
    return _schema({**fuzz_spec, "paths": {p: fuzz_spec["paths"][p] for p in life}}, "positive")


# First of the module: the admin's fuzz cases after it may change the run (a config change, a
# roll back), which the walk's uploads would then be refused by.
def test_a_stateful_walk_joins_uploads_polls_and_leaves(life_schema: Any, fuzz_server: BackgroundCoordinator,
                                                        zero_update: tuple[bytes, str]) -> None:
    """Schemathesis' state machine from the OpenAPI links; an upload that follows a join
    carries a real update, so that the walk goes on to the round's status and the leave."""
    body, digest = zero_update

    names = itertools.count()

    class Walk(life_schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            WALKS.append([])
            self.joined: dict[str, str] = {}

        def teardown(self) -> None:
            with httpx.Client(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
                for pid, key in self.joined.items():  # (the token holds at most 64 at once)
                    http.post(f"/v1/participants/{pid}/leave", headers={KEY_HEADER: key})

        def before_call(self, case: Any) -> None:
            if case.query and "wait" in case.query:  # a long-poll would only make the walk wait
                case.query["wait"] = 0
            if case.method == "POST" and case.path == "/v1/join" and isinstance(case.body, dict):
                case.body = {**case.body, "name": f"walk-{next(names)}"}  # a new one: the walk's steps repeat
            pid = (case.path_parameters or {}).get("pid") or (case.query or {}).get("participant_id")
            if pid in self.joined and KEY_HEADER not in (case.headers or {}):  # (a wrong key stays wrong)
                case.headers = {**(case.headers or {}), KEY_HEADER: self.joined[pid]}
            if case.method == "PUT" and KEY_HEADER in (case.headers or {}):  # (an upload that followed a join)
                case.body, case.media_type = body, "application/octet-stream"
                case.headers[DIGEST_HEADER] = digest
                # a whole upload: an upload's part (`part`, `total`, `part_bytes`) is fuzzed by the other modes
                whole = {k: v for k, v in (case.query or {}).items() if k not in ("part", "total", "part_bytes")}
                case.query = {**whole, "tokens": 10}

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": fuzz_server.url, "headers": {"Authorization": f"Bearer {PTOKEN}"}, "timeout": 30}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            CASES["stateful"] += 1
            WALKS[-1].append((f"{case.method} {case.path}", response.status_code))
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text}"
            if response.status_code >= 400:
                assert _shape_ok(response.json()), response.text
            elif case.path == "/v1/join":
                answer = response.json()
                self.joined[answer["participant_id"]] = answer["participant_key"]

    # The coordinator's state outlives an example (rounds close, participants come and go), so
    # Hypothesis may find a walk's next step enabled in one run of a prefix and not in the next
    # (FlakyStrategyDefinition): that ends the walks, it is no failure of the server; and no
    # shrinking, whose replays would not be the same walk.
    with contextlib.suppress(FlakyStrategyDefinition):
        Walk.run(settings=settings(max_examples=max(1, EXAMPLES * 3 // 4), stateful_step_count=16, deadline=None,
                                   derandomize=DERANDOMIZE, database=None, suppress_health_check=list(HealthCheck),
                                   phases=(Phase.explicit, Phase.generate)))
    flow = ["POST /v1/join", "PUT /v1/rounds/{round_}/updates/{pid}", "GET /v1/rounds/{round_}",
            "POST /v1/participants/{pid}/leave"]
    whole = [w for w in WALKS if _in_order(flow, [op for op, status in w if status == 200])]
    print(f"\n{len(whole)} of {len(WALKS)} walks went join -> upload -> round status -> leave")
    assert whole, f"no walk went join -> upload -> round status -> leave: {WALKS}"


FUZZ = settings(
    max_examples=max(1, EXAMPLES // 2),  # each mode half: the default run's time stays what it was
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@positive.parametrize()
@FUZZ
def test_no_server_errors_with_participant_token(case: Any, fuzz_server: BackgroundCoordinator) -> None:
    call(case, PTOKEN, fuzz_server)


@positive.parametrize()
@FUZZ
def test_no_server_errors_with_admin_token(case: Any, fuzz_server: BackgroundCoordinator) -> None:
    call(case, ATOKEN, fuzz_server)


@negative.parametrize()
@FUZZ
def test_inputs_that_violate_the_schema_are_a_4xx(case: Any, fuzz_server: BackgroundCoordinator) -> None:
    """As the admin (who may call every route: a 403 would hide what the validation does)."""
    response = call(case, ATOKEN, fuzz_server)
    if response.status_code != 400 or response.text != LINE_TOO_LONG:  # (a 400 too, from the HTTP server)
        case.validate_response(response, checks=[negative_data_rejection])


def _in_order(wanted: list[str], seen: list[str]) -> bool:
    """Whether `seen` holds the steps of `wanted` in this order (others between them)."""
    steps = iter(seen)
    return all(step in steps for step in wanted)


def test_the_fuzzers_ran_cases() -> None:
    """A fuzz run that generated nothing (a plugin incompatibility, a schema that lost its
    routes, links the state machine cannot follow) must not read as a pass: each mode ran cases."""
    print(f"\nschemathesis: {CASES['positive']} positive, {CASES['negative']} negative, "
          f"{CASES['stateful']} stateful cases")
    assert CASES["positive"] >= 20 and CASES["negative"] >= 20 and CASES["stateful"] >= 10, CASES
