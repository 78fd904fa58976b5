"""A streaming participant's fragments (`participant/engine/sync_schedule.py`, `SyncEngine.fragment`),
over a scripted coordinator: each round sends its fragment's Δ only and downloads only its
tensors, the arriving weights are mixed with α, and a failed exchange puts the reference back."""

from __future__ import annotations

import json
from typing import Any

import pytest
import safetensors.torch
import torch

from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorUnavailable, ModelMismatchError
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.engine.sync_schedule import Exchanges, plan_of
from fedtrain.participant.engine.sync_set import PieceOf
from fedtrain.wire import TensorSpec
from fedtrain.wire.format import ROWS_META


class Scripted:
    """A CoordinatorClient's surface: `model` is the global model of `version`; `rows`
    downloads send only the tensors named; every upload is kept, decoded."""

    def __init__(self, model: dict[str, torch.Tensor], version: int = 0) -> None:
        self.model, self.version = model, version
        self.uploads: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.downloads: list[list[str]] = []
        self.fail_upload = False

    def upload(self, r: int, pid: str, body: Any, tokens: int, **_: Any) -> dict:
        if self.fail_upload:
            raise CoordinatorUnavailable("gone", status=0, code="unavailable")
        self.uploads.append((r, safetensors.torch.load(b"".join(bytes(c) for c in body))))
        return {}

    def wait_round(self, r: int, pid: str | None, wait_s: float = 25.0, **_: Any) -> dict:
        return {"round": r, "state": "closed"}

    def download(self, *, pid: str, allocate: Any, on_header: Any = None, rows: Any = None, **_: Any) -> tuple:
        names = list(self.model) if rows is None else list(rows)
        self.downloads.append(names)
        specs = {n: TensorSpec(n, self.model[n].dtype, tuple(self.model[n].shape)) for n in names}
        if on_header is not None:
            on_header(specs, {})
        for n in names:
            allocate(specs[n]).copy_(self.model[n])
        return self.version, {}


def setup(a: float = 1.0, b: float = 2.0) -> tuple[Scripted, SyncEngine, dict[str, torch.nn.Parameter]]:
    params = {"a": torch.nn.Parameter(torch.zeros(3)), "b": torch.nn.Parameter(torch.zeros(2))}
    client = Scripted({"a": torch.full((3,), a), "b": torch.full((2,), b)})
    engine = SyncEngine(client, params, who="site")  # type: ignore[arg-type]
    engine.prepare({"a": {"dtype": "F32", "shape": [3]}, "b": {"dtype": "F32", "shape": [2]}})
    engine.load_global("p")
    return client, engine, params


def test_a_round_sends_and_fetches_its_fragment_only() -> None:
    client, engine, params = setup()
    fs = Exchanges(engine, [["a"], ["b"]])
    with torch.no_grad():
        params["a"].sub_(0.5)
        params["b"].sub_(0.25)
    client.model = {"a": torch.full((3,), 3.0), "b": torch.full((2,), 9.0)}
    client.version = 1
    assert fs.of(0) == 0 and fs.of(1) == 1 and fs.of(2) == 0
    assert fs.engines[fs.of(0)].fetch(0, "p", RunConfig(), tokens=4, retry=None) == 1
    fs.engines[0].mix(0.0)
    (r, up), = client.uploads
    assert r == 0 and set(up) == {"a"} and torch.equal(up["a"], torch.full((3,), 0.5))  # Δ = θ_g − θ
    assert client.downloads[-1] == ["a"]
    assert torch.equal(params["a"].detach(), torch.full((3,), 3.0))  # α = 0: the global fragment as it comes
    assert torch.equal(params["b"].detach(), torch.full((2,), 1.75))  # the other fragment keeps training
    assert fs.engines[0].bytes_up > 0 and fs.engines[0].bytes_down == 3 * 4 and fs.engines[1].bytes_down == 0


def test_the_arriving_fragment_is_mixed_with_alpha_and_stays_the_reference() -> None:
    client, engine, params = setup(a=1.0)
    fs = Exchanges(engine, [["a"], ["b"]])
    with torch.no_grad():
        params["a"].copy_(torch.full((3,), 2.0))  # θ_sent = 2: Δ = -1
    client.model["a"] = torch.full((3,), 4.0)
    client.version = 1
    fs.send(0, "p", RunConfig(), tokens=4, retry=None, record={})
    with torch.no_grad():
        params["a"].add_(1.0)  # τ more steps: θ_local = 3 at the apply
    version = fs.result()
    sent = fs.take()
    assert (sent.round, sent.fragment, version) == (0, 0, 1)
    fs.engines[0].mix(0.25)
    assert torch.allclose(params["a"].detach(), torch.full((3,), 0.75 * 4.0 + 0.25 * 3.0))
    assert torch.equal(client.uploads[0][1]["a"], torch.full((3,), -1.0))  # measured at the send
    with torch.no_grad():
        params["a"].copy_(torch.full((3,), 5.0))
    client.version = 2
    # fragment 0 again: Δ against θ_g = 4, not the mix
    fs.engines[fs.of(2)].fetch(2, "p", RunConfig(), tokens=4, retry=None)
    assert torch.equal(client.uploads[-1][1]["a"], torch.full((3,), -1.0))


def test_a_failed_send_puts_the_reference_back() -> None:
    client, engine, params = setup(a=1.0)
    fs = Exchanges(engine, [["a"], ["b"]])
    with torch.no_grad():
        params["a"].copy_(torch.full((3,), 1.5))
    client.fail_upload = True
    fs.send(0, "p", RunConfig(), tokens=4, retry=None, record={})
    with pytest.raises(CoordinatorUnavailable):
        fs.result()
    fs.failed(fs.take(), keep_progress=False)
    assert fs.pending is None and fs.engines[0].holds == "reference"
    client.fail_upload = False
    fs.engines[fs.of(0)].fetch(0, "p", RunConfig(), tokens=4, retry=None)  # the next attempt: Δ against θ_g = 1 again
    assert torch.equal(client.uploads[-1][1]["a"], torch.full((3,), -0.5))


def test_a_fragment_naming_tensors_the_model_does_not_sync_is_refused() -> None:
    _, engine, _ = setup()
    with pytest.raises(ModelMismatchError, match="fragment"):
        Exchanges(engine, [["a"], ["c"]])


def test_the_plan_comes_from_the_join_answer() -> None:
    assert plan_of({"config": {}}) is None
    assert plan_of({"config": {"streaming": {"fragments": 2}}, "streaming": {"fragments": [["a"], ["b"]], "k": 2}}) \
        == [["a"], ["b"]]
    with pytest.raises(ModelMismatchError, match="no fragment plan"):
        plan_of({"config": {"streaming": {"fragments": 2}}})
    with pytest.raises(ModelMismatchError, match="not a list"):
        plan_of({"config": {}, "streaming": {"fragments": [["a"], []]}})


def test_at_the_end_every_fragment_becomes_the_global_one_and_only_the_others_are_fetched() -> None:
    client, engine, params = setup(a=1.0, b=2.0)
    fs = Exchanges(engine, [["a"], ["b"]])
    with torch.no_grad():
        params["a"].add_(1.0)
        params["b"].add_(1.0)
    client.model = {"a": torch.full((3,), 4.0), "b": torch.full((2,), 7.0)}
    client.version = 3
    fs.engines[fs.of(2)].fetch(2, "p", RunConfig(), tokens=1, retry=None)
    fs.engines[0].mix(0.5)  # fragment 0 mixed: not the global weights yet
    assert not torch.equal(params["a"].detach(), torch.full((3,), 4.0))
    client.downloads.clear()
    fs.take_global("p", 3, 0, retry=None)
    assert client.downloads == [["b"]]  # fragment 0's global weights were in its snapshot already
    assert torch.equal(params["a"].detach(), torch.full((3,), 4.0))
    assert torch.equal(params["b"].detach(), torch.full((2,), 7.0))


class ScriptedRows(Scripted):
    """`Scripted`, whose `rows` downloads send each tensor's rows [start, stop) (None: whole), and
    whose uploads keep the body's metadata too."""

    def upload(self, r: int, pid: str, body: Any, tokens: int, **kw: Any) -> dict:
        raw = b"".join(bytes(c) for c in body)
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        self.uploads.append((r, {**safetensors.torch.load(raw), "_meta": header.get("__metadata__", {}),
                                 "_piece": kw.get("piece")}))
        return {}

    def download(self, *, pid: str, allocate: Any, on_header: Any = None, rows: Any = None, **_: Any) -> tuple:
        self.downloads.append(list(rows))
        for n, span in rows.items():
            t = self.model[n] if span is None else self.model[n][span[0]:span[1]]
            allocate(TensorSpec(n, t.dtype, tuple(t.shape))).copy_(t)
        return self.version, {}


def test_a_ranks_fragments_send_and_fetch_only_its_rows_of_each_fragment() -> None:
    """An FSDP rank (rank 1 of 2): rows [2, 4) of `a`, no row of the 1-row `b`, and `c` replicated,
    which rank 0 alone sends. Fragment 0 = `a`: its rows go up as its piece and come down; fragment
    1 = `b`, `c`: nothing of it goes up, `c` comes down whole."""
    shapes = {"a": (torch.float32, (4, 3)), "b": (torch.float32, (1, 3)), "c": (torch.float32, (2,))}
    params = {"a": torch.nn.Parameter(torch.zeros(2, 3)), "c": torch.nn.Parameter(torch.zeros(2))}
    client = ScriptedRows({"a": torch.arange(12.0).reshape(4, 3), "b": torch.ones(1, 3), "c": torch.full((2,), 5.0)})
    piece = PieceOf("rank1", frozenset({"a"}), {"a": (2, 4)}, shapes)
    engine = SyncEngine(client, params, who="site.rank1", piece=piece)  # type: ignore[arg-type]
    engine.prepare({n: {"dtype": "F32", "shape": list(s)} for n, (_, s) in shapes.items()})
    engine.load_global("p")
    fs = Exchanges(engine, [["a"], ["b", "c"]])
    with torch.no_grad():
        params["a"].sub_(1.0)
    client.model = {**client.model, "a": torch.full((4, 3), 7.0), "c": torch.full((2,), 8.0)}
    client.version = 1
    assert fs.engines[fs.of(0)].fetch(0, "p", RunConfig(), tokens=4, retry=None) == 1
    fs.engines[0].mix(0.5)
    (r, up), = client.uploads
    assert r == 0 and up["_piece"] == "rank1" and json.loads(up["_meta"][ROWS_META]) == {"a": [2, 4]}
    assert set(up) == {"a", "_meta", "_piece"} and torch.equal(up["a"], torch.ones(2, 3))  # Δ of our rows
    assert client.downloads[-1] == ["a"]
    want = 0.5 * torch.full((2, 3), 7.0) + 0.5 * (torch.arange(6.0, 12.0).reshape(2, 3) - 1.0)
    assert torch.equal(params["a"].detach(), want)
    assert torch.equal(params["c"].detach(), torch.full((2,), 5.0))  # not this round's fragment
    client.version = 2
    assert fs.engines[fs.of(1)].fetch(1, "p", RunConfig(), tokens=4, retry=None) == 2
    fs.engines[1].mix(0.0)
    assert len(client.uploads) == 1 and client.downloads[-1] == ["c"]  # rank 0 sends `c`; we take it whole
    assert torch.equal(params["c"].detach(), torch.full((2,), 8.0))
    nothing = engine.fragment(["b"])  # a fragment this rank holds no row of: it waits, and fetches nothing
    assert nothing.fetch(2, "p", RunConfig(), tokens=4, retry=None) == -1 and client.downloads[-1] == ["c"]
    with pytest.raises(ModelMismatchError):
        engine.fragment(["z"])
