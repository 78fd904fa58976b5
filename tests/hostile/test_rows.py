"""Rows from a hostile participant: the `fedtrain.rows` metadata of a piece and the `rows=`
query of a partial download. Whatever the value (too long, nested 100k deep, a row number of
thousands of digits, the wrong shape), the answer is a 4xx naming the field, never a 500, and
nothing is taken; an honest value still works after."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake.pieces import ROWS_META
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.api import assert_error, assert_unchanged, client, deltas, halves, send_piece, snapshot
from tests.helpers.config import tiny_config

HOSTILE = {
    "nested_100k": "[" * 100_000 + "]" * 100_000,
    "nested_20k": "[" * 20_000,  # under the length bounds (of a URL too): the parser's depth
    "digits_5000": '{"NAME": [0, ' + "9" * 5000 + "]}",
    "digits_4000": '{"NAME": [0, ' + "9" * 4000 + "]}",  # parses: its size is the check
    "negative": '{"NAME": [-1, 2]}',
    "reversed": '{"NAME": [2, 1]}',
    "float": '{"NAME": [0, 1.5]}',
    "bool": '{"NAME": [false, true]}',
    "three": '{"NAME": [0, 1, 2]}',
    "not_json": "{NAME: [0, 1]",
    "a_list": "[[0, 1]]",
    "a_string": '"NAME"',
    "nan": '{"NAME": [0, NaN]}',
}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path_factory.mktemp("rows") / "s", tiny_config()) as c, client(c) as http:
        for pid in ("p", "q"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
        yield c


def _piece(c: BackgroundCoordinator, raw: str) -> tuple[dict, str]:
    """The first half of p's update as a piece whose rows metadata is `raw` (NAME: a tensor of it)."""
    (t0, rows0), _ = halves(deltas(c, 1))
    name = next(iter(rows0))
    return t0, raw.replace("NAME", name)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_piece_with_hostile_rows_metadata_is_a_400_naming_it(coordinator: BackgroundCoordinator, kind: str) -> None:
    c = coordinator
    tensors, raw = _piece(c, HOSTILE[kind])
    enc = EncodedBody(tensors, {ROWS_META: raw})
    before = snapshot(c)
    with client(c) as http:
        r = http.put("/v1/rounds/0/updates/p", params={"tokens": 100, "piece": "r0"},
                     content=b"".join(bytes(x) for x in enc), headers={DIGEST_HEADER: enc.digest()})
        err = assert_error(r, 400)
        assert ROWS_META in err["message"] and len(err["message"]) < 500, err
        assert http.get("/v1/healthz").status_code == 200
    assert_unchanged(c, before)


def test_after_hostile_rows_the_honest_pieces_make_the_update(coordinator: BackgroundCoordinator) -> None:
    c = coordinator
    (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
    with client(c) as http:
        assert send_piece(http, "p", "r0", t0, rows0).json()["complete"] is False
        assert send_piece(http, "p", "r1", t1, rows1).json()["complete"] is True
        assert c.service.inspect().submitted == {"p": 100}


@pytest.mark.parametrize("kind", sorted(k for k in HOSTILE if k != "nested_100k"))  # (a URL's 64 KiB)
def test_a_download_with_hostile_rows_is_a_400_naming_it(coordinator: BackgroundCoordinator, kind: str) -> None:
    c = coordinator
    name = next(iter(c.service.inspect().weights))
    with client(c) as http:
        r = http.get("/v1/model", params={"rows": HOSTILE[kind].replace("NAME", name)})
        err = assert_error(r, 400, "invalid_rows")
        assert "rows" in err["message"] and len(err["message"]) < 500, err
        ok = http.get("/v1/model", params={"rows": f'{{"{name}": [0, 1]}}'})
        assert ok.status_code == 200 and int(ok.headers["content-length"]) > 0


def test_a_download_rows_query_over_its_bound_is_refused(coordinator: BackgroundCoordinator) -> None:
    """Past 64 KiB of rows the query is refused before it is parsed (the bound is in the schema)."""
    spec = httpx.get(f"{coordinator.url}/v1/openapi.json").json()
    params = spec["paths"]["/v1/model"]["get"]["parameters"]
    rows = next(p for p in params if p["name"] == "rows")["schema"]
    assert next(s for s in rows["anyOf"] if s.get("type") == "string")["maxLength"] == 1 << 16
