"""Downloads of some rows of the global model (`GET /v1/model?rows=...`, `coordinator/slices.py`):
what a rank of a sharded job holds. The rows equal those of the whole model, from memory (the
published version) and from the file (an older one), fast IO on and off, the same bytes from
either source; two ranks' slices make the whole model; under commit first a slice waits for its
round's commit like a whole download, and is cut short when that commit fails; bad `rows` are 400."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake.pieces import ROWS_META
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.client import coordinator_client as client_module
from fedtrain.wire import DIGEST_HEADER, digest_bytes, read_tensors, write_file
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import PTOKEN, tiny_config


def init_model(tmp_path: Path) -> Path:
    """A model of a few tensors: one large enough for many chunks, an empty one, a scalar."""
    g = torch.Generator().manual_seed(0)
    params = {"lin.weight": torch.randn(1000, 700, generator=g), "lin.bias": torch.randn(1000, generator=g),
              "empty": torch.empty(0), "scale": torch.tensor(1.5), "head.weight": torch.randn(3, 5, generator=g)}
    path = tmp_path / "init.safetensors"
    write_file(path, params)
    return path


def rank_rows(params: dict[str, torch.Tensor], rank: int) -> dict[str, list[int] | None]:
    """What rank `rank` of two holds: its half of the rows of every tensor with two rows or
    more; the others whole, on rank 0."""
    rows: dict[str, list[int] | None] = {}
    for name, t in params.items():
        n = t.shape[0] if t.dim() else 1
        if n < 2:
            if rank == 0:
                rows[name] = None
            continue
        cut = n // 2
        rows[name] = [0, cut] if rank == 0 else [cut, n]
    return rows


def next_round(c: BackgroundCoordinator, http: httpx.Client, round_: int) -> None:
    """Both participants send round `round_`; returns once its version is committed."""
    g = torch.Generator().manual_seed(round_)
    for pid in ("a", "b"):
        delta = {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in c.service.inspect().weights.items()}
        assert put(http, round_, pid, delta).status_code == 200
    wait_for(lambda: c.service.inspect().committed_version == round_ + 1, f"round {round_} did not commit")


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def raw_slice(http: httpx.Client, rows: dict, version: int | None = None, pid: str = "a") -> httpx.Response:
    params: dict[str, object] = {"rows": json.dumps(rows), "participant_id": pid}
    if version is not None:
        params["version"] = version
    return http.get("/v1/model", params=params)


@pytest.mark.parametrize("fast_io", [True, False], ids=["fast", "plain"])
def test_slices_are_the_rows_of_the_model_from_memory_and_from_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_io: bool) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=init_model(tmp_path),
                               fast_io=fast_io) as c, client(c) as http, CoordinatorClient(c.url, PTOKEN) as cl:
        for pid in ("a", "b"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
        next_round(c, http, 0)
        assert c.service.committer.published is not None and c.service.committer.published.version == 1
        memory_bytes = {rank: raw_slice(http, rank_rows(c.service.inspect().weights, rank), 1).content
                        for rank in (0, 1)}
        next_round(c, http, 1)  # version 1 now comes from its file, version 2 from memory
        for version in (2, 1, 0):
            _, whole = cl.download(version=version)
            union: dict[str, list[torch.Tensor]] = {}
            for rank in (0, 1):
                rows = rank_rows(whole, rank)
                for direct in (True, False):
                    monkeypatch.setattr(client_module, "is_direct", lambda url, d=direct: d)
                    buffers: dict[str, torch.Tensor] = {}
                    metas: list[dict[str, str]] = []

                    def allocate(spec, buffers=buffers):  # type: ignore[no-untyped-def]
                        buffers[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
                        return buffers[spec.name]

                    got_version, got = cl.download(version=version, rows=rows, allocate=allocate,
                                                   on_header=lambda _s, m, metas=metas: metas.append(m))
                    assert got_version == version and list(got) == list(rows)  # only those, in the model's order
                    for name, span in rows.items():
                        want = whole[name] if span is None else whole[name][span[0]:span[1]]
                        assert torch.equal(got[name], want), (version, rank, name)
                        assert not got[name].numel() or got[name].data_ptr() == buffers[name].data_ptr()
                    assert json.loads(metas[0][ROWS_META]) == {n: s for n, s in rows.items() if s is not None}
                    assert metas[0]["version"] == str(version) and metas[0]["run"] == "test"
                for name, t in got.items():
                    union.setdefault(name, []).append(t)
                r = raw_slice(http, rows, version)
                assert r.headers[DIGEST_HEADER] == digest_bytes(r.content)
                assert r.headers["content-length"] == str(len(r.content))
                assert r.headers["x-fedtrain-version"] == str(version)
                if version == 1:  # from the file: the same bytes it had from memory
                    assert r.content == memory_bytes[rank]
            for name, t in whole.items():  # two ranks' slices make the whole model
                assert torch.equal(torch.cat(union[name]) if t.dim() else union[name][0], t), name
        served = dict(read_tensors([c.service.inspect().checkpoints.global_path(1).read_bytes()]))
        got = dict(read_tensors([memory_bytes[0]]))
        assert torch.equal(got["lin.weight"], served["lin.weight"][:500])
        a = next(p for p in http.get("/v1/status").json()["participants"] if p["id"] == "a")
        before = a["bytes_down"]
        r = raw_slice(http, {"head.weight": [1, 2]})
        a = next(p for p in http.get("/v1/status").json()["participants"] if p["id"] == "a")
        assert a["bytes_down"] == before + len(r.content)  # counted as the participant's download


def held_slice(c: BackgroundCoordinator, http: httpx.Client, rows: dict, fails: bool) -> None:
    """The next round commits slowly (and fails, if `fails`): a slice of its version fetched
    meanwhile ends only once it is committed, or is cut short."""
    before = c.service.inspect().committed_version
    rules = [faults.arm(faults.Rule("checkpoint.after_global_write", "sleep", seconds=1.5, round=before))]
    if fails:
        rules.append(faults.arm(faults.Rule("commit.before_db", "raise", round=before)))
    try:
        g = torch.Generator().manual_seed(before)
        for pid in ("a", "b"):
            delta = {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in c.service.inspect().weights.items()}
            assert put(http, before, pid, delta).status_code == 200
        wait_for(lambda: c.service.version == before + 1, "the round was not merged")
        assert c.service.inspect().committed_version == before  # the commit sleeps
        seen: dict[str, object] = {}

        def fetch() -> None:
            try:
                r = raw_slice(http, rows, before + 1)
                seen["committed"] = c.service.inspect().committed_version
                seen["body"] = r.content
            except httpx.HTTPError as e:
                seen["error"] = e

        t = threading.Thread(target=fetch)
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # held: the commit is not done
        t.join(timeout=30)
        if fails:  # cut short: the client never gets the whole body
            assert isinstance(seen.get("error"), httpx.HTTPError), seen
            wait_for(lambda: c.service.version == before and not c.service.status()["closing"], "no going back")
        else:
            assert seen["committed"] == before + 1, seen  # it ended once the round was committed
            assert isinstance(seen["body"], bytes)
            tensors = dict(read_tensors([seen["body"]]))
            whole = dict(read_tensors([c.service.inspect().checkpoints.global_path(before + 1).read_bytes()]))
            assert torch.equal(tensors["lin.weight"], whole["lin.weight"][500:])
    finally:
        faults.disarm()
    assert all(rule.fired for rule in rules)


@pytest.mark.parametrize("fast_io", [True, False], ids=["fast", "plain"])
def test_commit_first_a_slice_waits_for_the_commit_and_is_cut_short_if_it_fails(tmp_path: Path,
                                                                                fast_io: bool) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=init_model(tmp_path),
                               fast_io=fast_io) as c, client(c) as http:
        for pid in ("a", "b"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
        rows = rank_rows(c.service.inspect().weights, 1)
        held_slice(c, http, rows, fails=False)
        held_slice(c, http, rows, fails=True)


BAD_ROWS = [
    "not json", "[1, 2]", "{}", '"lin.weight"', json.dumps({"nope": None}), json.dumps({"lin.weight": [0, 1001]}),
    json.dumps({"lin.weight": [5, 5]}), json.dumps({"lin.weight": [-1, 5]}), json.dumps({"lin.weight": [0, 1, 2]}),
    json.dumps({"lin.weight": [True, 3]}), json.dumps({"lin.weight": [0.0, 3]}), json.dumps({"lin.weight": "0:3"}),
    json.dumps({"scale": [0, 1]}), json.dumps({"empty": [0, 1]}), '{"lin.weight": [0, 1e999]}',
    '{"lin.weight": [0, ' + "9" * 5000 + "]}", "[" * 20_000,
    json.dumps({"lin.weight": None, "x" * 200: None}),  # too long (MAX_ROWS_CHARS made 100 below)
]


def test_bad_rows_are_refused_with_400(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedtrain.coordinator.model import slices

    monkeypatch.setattr(slices, "MAX_ROWS_CHARS", 100)  # a URL's query stops at 64 KiB in httpx
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=init_model(tmp_path)) as c, \
            client(c) as http:
        for rows in BAD_ROWS:
            r = http.get("/v1/model", params={"rows": rows})
            assert_error(r, 400, "invalid_rows")
        r = http.get("/v1/model", params={"rows": json.dumps({"scale": None}), "version": 7})
        assert_error(r, 404, "version_not_kept")
        r = http.get("/v1/model", params={"rows": json.dumps({"scale": None, "empty": None})})
        assert r.status_code == 200 and {n for n, _ in read_tensors([r.content])} == {"empty", "scale"}
