"""A participant's parts that need no coordinator: local state (checkpoint in safetensors +
JSON, no pickle; metrics log), eval cadence, the sync engine and the overlapped sync over a
scripted coordinator, per-call retry budgets, and the httpcore read-size switch."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from fedtrain.cli.report import eval_rows, format_evals
from fedtrain.config import RunConfig
from fedtrain.coordinator.model.global_eval import version_due
from fedtrain.errors import CoordinatorUnavailable, StateError
from fedtrain.participant import Participant
from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.engine.sync_schedule import Exchanges
from fedtrain.participant.local.checkpoint import LocalCheckpoint
from fedtrain.participant.local.metrics_log import MetricsLog
from fedtrain.recipes import TokenStream
from fedtrain.wire import TensorSpec


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_checkpoint_restores_optimizer_and_data_position_exactly(tmp_path: Path) -> None:
    _, opt = _trained(3)
    stream = TokenStream(torch.arange(5000) % 256, batch_size=4, seq_len=16, seed=7)
    for _ in range(5):
        stream.next_batch()
    ckpt = LocalCheckpoint(tmp_path / "ckpt")
    assert ckpt.load(opt) is None and not ckpt.exists()
    ckpt.save(round_=4, optimizer=opt, steps=15, tokens=960, user_state={"data": stream.state_dict()})

    fresh_model, _ = _trained(0)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=99.0)
    record = LocalCheckpoint(tmp_path / "ckpt").load(fresh)
    assert record is not None and (record["round"], record["steps"], record["tokens"]) == (4, 15, 960)
    want, got = opt.state_dict(), fresh.state_dict()
    assert want["param_groups"] == got["param_groups"]  # lr, betas (a tuple again), weight decay
    assert want["state"].keys() == got["state"].keys()
    for i, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, got["state"][i][key]), (i, key)
    resumed = TokenStream(torch.arange(5000) % 256, batch_size=4, seq_len=16, seed=0)
    resumed.load_state_dict(record["user_state"]["data"])
    assert torch.equal(resumed.next_batch()[0], stream.next_batch()[0])


def test_checkpoint_files_are_safetensors_and_json_only(tmp_path: Path) -> None:
    _, opt = _trained(2)
    ckpt = LocalCheckpoint(tmp_path)
    ckpt.save(round_=1, optimizer=opt)
    ckpt.save(round_=2, optimizer=opt)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["optimizer-2.safetensors", "state.json"], files  # older tensor files are removed
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["optimizer"]["file"] == "optimizer-2.safetensors"
    assert state["optimizer"]["digest"].startswith("xxh3-128:")
    raw = (tmp_path / "optimizer-2.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and json.loads(raw[8 : 8 + header_len])  # a safetensors JSON header, not a pickle
    assert b"\x80\x04" not in raw[:2] and b"\x80\x05" not in raw[:2]


def test_a_damaged_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    _, opt = _trained(1)
    LocalCheckpoint(tmp_path).save(round_=0, optimizer=opt)
    f = tmp_path / "optimizer-0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(StateError, match="cannot be restored"):
        LocalCheckpoint(tmp_path).load(opt)


def test_metrics_log_writes_json_lines(tmp_path: Path) -> None:
    with MetricsLog(tmp_path, tensorboard=False) as m:
        m.write({"round": 0, "train_loss": 2.5, "eval_before/loss": 2.4})
        m.write({"round": 1, "train_loss": 2.1})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1] and lines[0]["eval_before/loss"] == 2.4 and "ts" in lines[0]


def test_metrics_go_to_tensorboard_when_installed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with MetricsLog(tmp_path) as m:
        assert m.tensorboard
        m.write({"round": 0, "train_loss": 2.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "every,rounds,due",
    [(1, 4, [0, 1, 2, 3]), (2, 5, [0, 2, 4]), (3, 5, [0, 3, 4]), (2, 0, [0, 2, 4, 6])],
)
def test_eval_cadence(every: int, rounds: int, due: list[int]) -> None:
    cfg = RunConfig.model_validate({"rounds": rounds, "eval": {"every": every}})
    fed = Participant("http://127.0.0.1:9", token="t", model=torch.nn.Linear(2, 2), eval_fn=lambda m: 0.0)
    fed.book.joined({"config": cfg.model_dump(mode="json"), "config_version": 1})
    assert fed.config == cfg
    assert [r for r in range(7 if rounds == 0 else rounds) if fed.book.eval_due(r)] == due
    # the coordinator evaluates the global model those rounds produce (version r + 1), and the initial one
    assert [v for v in range(8 if rounds == 0 else rounds + 1) if version_due(v, cfg)] == [0] + [r + 1 for r in due]


def test_eval_rows_and_table() -> None:
    def m(pid: str | None, r: int, name: str, value: float) -> dict:
        return {"participant_id": pid, "round": r, "name": name, "value": value}

    metrics = [
        m(None, 0, "global_eval/loss", 5.5),
        m("p0", 0, "tokens", 640),
        m("p0", 0, "train_loss", 5.2),
        m("p0", 0, "eval_before/loss", 5.0),
        m("p0", 0, "eval_after/loss", 4.9),
        m("p1", 0, "eval_before/loss", 5.1),
        m("p1", 0, "eval_after/loss", 4.9),
        m(None, 1, "global_eval/loss", 4.8),
        m("p0", 1, "train_loss", 4.7),  # a round without evals (eval.every) is left out
    ]
    rows = eval_rows(metrics)
    assert [(r["round"], r["participant"]) for r in rows] == [(-1, "(initial)"), (0, "p0"), (0, "p1")]
    assert rows[1]["before"] == {"loss": 5.0} and rows[1]["after"] == {"loss": 4.9}
    assert rows[1]["global_after"] == {"loss": 4.8} and rows[1]["tokens"] == 640
    text = format_evals(rows)
    assert "before sync" in text and "after sync" in text and "5.500" in text and "4.800" in text
    assert text.count("4.800") == 1  # the global eval is shown once per round


# -- the sync engine, over a scripted coordinator ---------------------------------------------


class Scripted:
    """Stands in for a CoordinatorClient: answers `wait_round` from a script, serves `model`
    as global version `version`, and records every call with the retry policy it was given."""

    def __init__(self, model: dict[str, torch.Tensor], states: list[Any], version: int = 1) -> None:
        self.model, self.states, self.version = model, list(states), version
        self.calls: list[tuple[str, RetryPolicy | None]] = []
        self.uploads: list[dict[str, torch.Tensor]] = []
        self.fail_download = False
        self.transfer: tuple[Any, Any] = (None, 1)

    def upload(self, r: int, pid: str, body: Any, tokens: int, *, retry: RetryPolicy | None = None,
               **transfer: Any) -> dict:
        self.calls.append(("upload", retry))
        self.uploads.append(safetensors.torch.load(b"".join(bytes(c) for c in body)))
        return {}

    def wait_round(self, r: int, pid: str, wait_s: float = 25.0, *, retry: RetryPolicy | None = None) -> dict:
        self.calls.append(("wait", retry))
        state = self.states.pop(0)
        if isinstance(state, Exception):
            raise state
        return state

    def download(self, *, pid: str, allocate: Any, on_header: Any, retry: RetryPolicy | None = None,
                 stall_timeout_s: float | None = None, streams: int | str = 1) -> tuple:
        self.calls.append(("download", retry))
        self.transfer = (stall_timeout_s, streams)  # the run config's `transfer`, as a sync passes it
        if self.fail_download:
            raise CoordinatorUnavailable("gone", status=0, code="unavailable")
        specs = {n: TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in self.model.items()}
        on_header(specs, {})
        for n, t in self.model.items():
            allocate(specs[n]).copy_(t)
        return self.version, {}


def _engine(client: Scripted, w: float) -> tuple[SyncEngine, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.full((3,), w))
    engine = SyncEngine(client, {"w": param}, who="site")  # type: ignore[arg-type]
    engine.prepare({"w": {"dtype": "F32", "shape": [3]}})
    return engine, param


def test_the_engine_sends_again_when_the_round_lost_our_upload_and_takes_the_new_model() -> None:
    client = Scripted({"w": torch.full((3,), 5.0)}, [
        {"state": "open", "submitted": False},  # the coordinator restarted and lost our upload
        {"state": "closing", "submitted": True},
        {"state": "closed"},
    ], version=1)
    engine, param = _engine(client, 0.0)
    engine.load_global("p")  # θ_0 = 5 in the snapshot and the model
    with torch.no_grad():
        param.sub_(1.0)  # local training: θ = 4
    policy = RetryPolicy(max_elapsed_s=3.0)
    client.version = 2
    assert engine.sync(0, "p", RunConfig(), tokens=7, retry=policy) == 2
    assert [c for c, _ in client.calls[1:]] == ["upload", "wait", "upload", "wait", "wait", "download"]
    assert all(r is policy for _, r in client.calls[1:])  # every call of the attempt under its budget
    assert len(client.uploads) == 2 and all(torch.equal(u["w"], torch.full((3,), 1.0)) for u in client.uploads)
    assert torch.equal(param.detach(), torch.full((3,), 5.0)) and engine.holds == "reference"
    assert engine.bytes_up > 0 and engine.bytes_down == 2 * 3 * 4
    assert client.transfer == (RunConfig().transfer.stall_timeout_s, RunConfig().transfer.streams)  # a sync's


def test_a_failed_sync_puts_the_reference_back_and_a_cut_download_is_fetched_again() -> None:
    client = Scripted({"w": torch.full((3,), 5.0)}, [{"state": "closed"}])
    engine, param = _engine(client, 0.0)
    engine.load_global("p")
    with torch.no_grad():
        param.sub_(1.0)
    client.fail_download = True
    with pytest.raises(CoordinatorUnavailable):
        engine.sync(0, "p", RunConfig(), tokens=1)
    assert engine.holds == "cut_short"  # round 0 is over: the next attempt only downloads
    client.fail_download = False
    client.calls.clear()
    engine.sync(0, "p", RunConfig(), tokens=1)
    assert [c for c, _ in client.calls] == ["download"]

    client.states = [{"state": "open", "submitted": True}, CoordinatorUnavailable("gone", status=0)]
    with torch.no_grad():
        param.sub_(1.0)
    with pytest.raises(CoordinatorUnavailable):
        engine.sync(1, "p", RunConfig(), tokens=1)
    assert engine.holds == "reference"
    client.states = [{"state": "closed"}]
    engine.sync(1, "p", RunConfig(), tokens=1)  # the same Δ again: θ_round was put back
    assert torch.equal(client.uploads[-1]["w"], torch.full((3,), 1.0))


def test_an_overlapped_exchange_lands_as_the_global_model_plus_local_progress() -> None:
    client = Scripted({"w": torch.full((3,), 5.0)}, [{"state": "closed"}], version=1)
    engine, param = _engine(client, 0.0)
    engine.load_global("p")
    with torch.no_grad():
        param.add_(1.0)  # θ_sent = 6: Δ = -1
    client.model = {"w": torch.full((3,), 10.0)}
    client.version = 2
    overlap = Exchanges(engine, None)
    try:
        overlap.send(1, "p", RunConfig(), tokens=4, retry=None, record={"round": 1})
        with torch.no_grad():
            param.add_(0.5)  # training goes on meanwhile
        assert overlap.pending is not None and overlap.result() == 2 and overlap.ready
        landed = overlap.take()
        assert (landed.round, landed.fragment, landed.record) == (1, 0, {"round": 1}) and landed.sent is not None
        engine.adopt(landed.sent)
    finally:
        overlap.close()
    assert torch.equal(client.uploads[0]["w"], torch.full((3,), -1.0))
    assert torch.equal(param.detach(), torch.full((3,), 10.5)) and overlap.pending is None
    assert [r for _, r in client.calls[1:]] == [None, None, None]  # the client's own policy


# -- the client ------------------------------------------------------------------------------


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now: connections are refused


def test_a_call_takes_its_own_retry_budget_and_leaves_the_clients_alone() -> None:
    default = RetryPolicy(initial_s=0.5, max_elapsed_s=60.0, first_contact_s=60.0)
    with CoordinatorClient(_refused_url(), "t", retry=default) as client:
        t0 = time.monotonic()
        with pytest.raises(CoordinatorUnavailable, match=r"retried for 0.2s"):
            client.health(retry=RetryPolicy(initial_s=0.05, max_elapsed_s=0.2))
        assert time.monotonic() - t0 < 5.0
        assert client.retry is default
    assert default.within(2.0) == RetryPolicy(initial_s=0.5, max_backoff_s=2.0, max_elapsed_s=2.0,
                                              first_contact_s=60.0)


def test_httpcore_reads_are_tuned_when_fast_io_is_on_and_put_back_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from httpcore._sync.http11 import HTTP11Connection

    from fedtrain.transport.http_client import READ_BYTES, tune_httpcore

    def read_size() -> int:
        return HTTP11Connection.READ_NUM_BYTES

    try:
        tune_httpcore(False)
        original = read_size()
        assert original < READ_BYTES  # httpcore's own 64 KiB
        for value, tuned in [("", True), ("1", True), ("OFF", False), ("no", False), (" False ", False), ("0", False)]:
            monkeypatch.setenv("FEDTRAIN_FAST_IO", value)
            CoordinatorClient("http://127.0.0.1:9", "t").close()  # a client sets it as it is created
            assert read_size() == (READ_BYTES if tuned else original), value
        assert tune_httpcore(True) and read_size() == READ_BYTES
        assert not tune_httpcore(False) and read_size() == original
    finally:
        monkeypatch.delenv("FEDTRAIN_FAST_IO", raising=False)
        tune_httpcore()
