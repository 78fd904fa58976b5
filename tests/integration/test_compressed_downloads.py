"""Compressed downloads end to end over loopback (#32): participants that hold version r take
r -> r + 1 as a compressed delta (topk, with the coordinator's error feedback) and end on the
coordinator's served model bit for bit, through a coordinator restart (the residual comes back
from its checkpoint) and a participant that leaves and joins again (a whole download); the
status counts the compressed bytes sent and their ratio to fp32. Then how it composes: FedOpt,
FedAvg, balanced and asynchronous rounds, publish_first, parallel streams, a robust
aggregator, a roll back, LoRA, Streaming DiLoCo fragments, a live change of the field, and
central DP."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import OutagePolicy, Participant, RetryPolicy
from fedtrain.wire import DIGEST_HEADER, read_tensors
from tests.helpers.config import ATOKEN, BOTH_TRANSPORTS, PTOKEN, tiny_config
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, run_all

WIDE = functools.partial(Small, width=1024)
# topk (up or down) needs an outer step without momentum (config/compression.py): outer SGD at lr 1.
OUTER = {"algorithm": "fedavg"}
TRAIN = {"sync_every": 4, "compression": "topk", "topk_density": 0.25, "topk_chunk": 64, "topk_bits": 4,
         "download_compression": "topk", "download_topk_density": 0.1}


def _task(seed: int) -> Regression:
    return Regression(rows=16, seed=seed, model=WIDE, lr=0.002)


def _served(url: str) -> tuple[dict[str, torch.Tensor], str]:
    """The model the coordinator serves now, as a participant downloads it, and its digest."""
    r = httpx.get(f"{url}/v1/model", headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(read_tensors(iter([r.content]))), r.headers[DIGEST_HEADER]


def _assert_bitwise(ours: dict[str, torch.Tensor], served: dict[str, torch.Tensor], who: str) -> None:
    assert set(ours) == set(served), who
    for name, t in served.items():
        assert torch.equal(ours[name].contiguous().view(torch.int32), t.contiguous().view(torch.int32)), (who, name)


@BOTH_TRANSPORTS  # the delta comes through the direct client and through httpx
def test_two_participants_end_on_the_served_model_bit_for_bit(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, min_participants=2, train=TRAIN, outer=OUTER)
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c:
        ps = run_all(TinyParticipant(c.url, f"p{i}", _task(i)) for i in range(2))
        status = c.service.status()
        served, _ = _served(c.url)
    for p in ps:
        assert p.fed is not None and p.fed.round == 4
        _assert_bitwise(p.weights, served, str(p.name))
        assert p.losses[-1] < p.losses[0]
    fp32 = sum(4 * t.numel() for t in served.values())
    for p in ps:  # the join's download is whole; each round's after it a delta, a small share of fp32
        assert p.fed is not None
        downs = [rec["bytes_down"] for rec in p.fed.history]
        assert all(0 < d < fp32 * 0.2 for d in downs), (downs, fp32)
    rounds = status["recent_rounds"]
    assert rounds and all(r["bytes_out"] and r["vs_fp32_out"] > 3 for r in rounds), rounds
    assert all(r["fp32_bytes_out"] > r["bytes_out"] for r in rounds)
    shown = format_status(status)  # `fedtrain status` shows the ratio
    assert "fp32 / down" in shown and f"{rounds[0]['vs_fp32_out']:g}x" in shown


def _residual(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in c.service.committer.deltas.residual.items()}


def test_bit_identity_holds_through_a_coordinator_restart_and_a_rejoin(tmp_path: Path) -> None:
    """p0 pauses in round 3 while the coordinator restarts over the same state (its residual
    comes back from the checkpoint); p1 leaves after round 4 and joins again under its name
    (whole download, then deltas). Both end on the served model, bit for bit."""
    cfg = tiny_config(rounds=7, min_participants=2, train=TRAIN, outer=OUTER)
    state, init = tmp_path / "state", init_file(tmp_path, WIDE())
    at_restart, restarted = threading.Event(), threading.Event()

    def pause_in_round_3(fed: Participant, _loss: float) -> None:
        if fed.round == 3 and not at_restart.is_set():
            at_restart.set()
            assert restarted.wait(60), "the coordinator did not come back"

    patient = {"retry": RetryPolicy(max_elapsed_s=60),
               "outage": OutagePolicy(budget_s=60, backoff_initial_s=0.2, backoff_max_s=1.0)}

    c1 = BackgroundCoordinator(state, cfg, init_weights=init).start()
    c2: BackgroundCoordinator | None = None
    try:
        p0 = TinyParticipant(c1.url, "p0", _task(0), on_step=pause_in_round_3, **patient).start()
        p1 = TinyParticipant(c1.url, "p1", _task(1), steps=5 * TRAIN["sync_every"], **patient).start()
        assert at_restart.wait(120), "p0 never reached round 3"
        c1.stop()
        kept = _residual(c1)
        assert kept and (state / "checkpoints" / "residual-000003.safetensors").is_file()
        c2 = BackgroundCoordinator(state, cfg, init_weights=init, port=c1.port).start()
        restored = _residual(c2)
        assert set(restored) == set(kept) and all(torch.equal(restored[n], kept[n]) for n in kept)
        restarted.set()
        p1.join(120)  # it left after round 4
        assert p1.fed is not None and 4 <= p1.fed.round < 7  # (5 unless an outage cost it a sync)
        left_at = p1.fed.round
        p1b = TinyParticipant(c2.url, "p1", _task(1), **patient).start()  # joins again, under its name
        p0.join(120)
        p1b.join(120)
        status = c2.service.status()
        served, _ = _served(c2.url)
    finally:
        restarted.set()
        for c in (c1, c2):
            if c is not None:
                c.stop()
    for p in (p0, p1b):
        assert p.fed is not None and p.fed.round == 7
        _assert_bitwise(p.weights, served, str(p.name))
    fp32 = sum(4 * t.numel() for t in served.values())
    assert p1b.fed is not None and p1b.joined_at == left_at  # p0 waited for a second participant there
    assert all(0 < rec["bytes_down"] < fp32 * 0.2 for rec in p1b.fed.history)  # deltas after its whole join
    by = {r["round"]: r for r in status["recent_rounds"]}  # (the rounds before the restart: counted by c1)
    whole = left_at - 1  # the round that made the version p1 joined again at: also sent whole, to it
    assert all(by[r]["vs_fp32_out"] > 3 for r in range(3, 7) if r != whole), by  # 3: the first merge after the restart
    assert by[whole]["bytes_out"] > by[3 if whole != 3 else 4]["bytes_out"] + fp32


SLOW = pytest.mark.slow  # the default run keeps one FedOpt and the asynchronous mode (a participant behind)


@pytest.mark.parametrize("overrides", [
    pytest.param({"outer": {"algorithm": "diloco"}, "train": {**TRAIN, "compression": "int8",
                                                              "download_compression": "int8"}},
                 marks=SLOW, id="diloco"),
    pytest.param({"outer": {"algorithm": "diloco"}, "train": {**TRAIN, "compression": "int2",
                                                              "download_compression": "int2"}},
                 id="diloco_int2"),
    pytest.param({"outer": {"algorithm": "diloco"}, "train": {**TRAIN, "compression": "ternary",
                                                              "download_compression": "ternary"}},
                 marks=SLOW, id="diloco_ternary"),
    pytest.param({"outer": {"algorithm": "diloco"},
                  "train": {**TRAIN, "compression": "int2", "compression_block": 64, "download_compression": "int2",
                            "entropy_coding": "deflate", "compression_scale": "bf16"}},
                 id="diloco_int2_deflate_bf16"),
    pytest.param({"outer": {"algorithm": "fedadam"}}, id="fedadam"),
    pytest.param({"schedule": {"mode": "balanced"}}, marks=SLOW, id="balanced"),
    pytest.param({"schedule": {"mode": "async"}, "asynchronous": {"outer_step": "per_update"}, "min_participants": 1,
                  "rounds": 8}, id="async"),
    pytest.param({"publish_first": True}, marks=SLOW, id="publish_first"),
    pytest.param({"transfer": {"streams": 2}}, marks=SLOW, id="two_streams"),
    pytest.param({"outer": {"aggregator": "median"}, "train": {**TRAIN, "compression": "int8",
                                                              "download_compression": "int8"}},
                 marks=SLOW, id="median"),
])
def test_compressed_downloads_compose(tmp_path: Path, overrides: dict) -> None:
    """DiLoCo (dense codecs; dense 2-bit both ways in the default run), FedOpt, balanced and
    asynchronous rounds: each participant ends on the served model bit for bit (async: one that
    is behind takes the model whole, the others a delta)."""
    cfg = tiny_config(**{"rounds": 4, "min_participants": 2, "train": {**TRAIN, "download_compression": "int8"},
                         **overrides, "outer": {**OUTER, **overrides.get("outer", {})}})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c:
        ps = run_all(TinyParticipant(c.url, f"p{i}", _task(i), step_sleep_s=0.002 * i) for i in range(2))
        status = c.service.status()
        served, _ = _served(c.url)
    for p in ps:
        _assert_bitwise(p.weights, served, str(p.name))
    assert any(r["vs_fp32_out"] and r["vs_fp32_out"] > 2 for r in status["recent_rounds"]), status["recent_rounds"]


def test_after_a_roll_back_the_model_goes_whole_then_deltas_again(tmp_path: Path) -> None:
    """An admin's roll back commits the kept weights as a new version with no delta (409: the
    participant downloads it whole) and starts the residual from zero; the next round's delta
    leads from it to the next version's digest."""
    from fedtrain.participant import CoordinatorClient
    from fedtrain.participant.engine.served import ServedModel
    from tests.helpers.api import client, commit_round_0, put

    cfg = tiny_config(rounds=0, keep_checkpoints=3, outer=OUTER, train={"download_compression": "topk",
                                                           "download_topk_density": 0.05, "topk_chunk": 256})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c, client(c, ATOKEN) as admin, \
            CoordinatorClient(c.url, PTOKEN) as http:
        pid = http.join("a")["participant_id"]
        held = ServedModel()
        assert held.take_whole(http, pid, lambda *_: None, None, {})[0] == 0
        commit_round_0(c, admin, pid)  # version 1
        assert held.take_delta(http, pid, None, None) is not None and held.version == 1
        assert c.service.committer.deltas.residual  # topk 5% left most of the step in E
        assert admin.post("/v1/admin/rollback", json={"version": 0}).status_code == 200  # version 2
        assert held.take_delta(http, pid, None, None) is None  # 409: no delta to a restored version
        assert not c.service.committer.deltas.residual
        assert held.take_whole(http, pid, lambda *_: None, None, {})[0] == 2
        step = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
        assert put(admin, 2, pid, step).status_code == 200
        admin.get("/v1/rounds/2", params={"wait": 10})
        assert held.take_delta(http, pid, None, None) is not None and held.version == 3  # digest checked
        served, _ = _served(c.url)
    _assert_bitwise(held.tensors, served, "a")


@pytest.mark.slow  # ~8 s: a tiny Llama per participant
def test_lora_adapters_come_down_as_deltas(tmp_path: Path) -> None:
    """LoRA: the sync set is the adapters, so only their delta travels down; both recipe
    participants end on the served adapters, bit for bit."""
    from fedtrain.wire import iter_file
    from tests.helpers.runs import LLAMA, run_two

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = tiny_config(model={"recipe": "hf", "hf": {"config": LLAMA}, "lora": lora}, rounds=3, min_participants=2,
                      train={"sync_every": 3, "lr": 1e-2, "download_compression": "int8"})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        results = run_two(c.url, tmp_path)
        status = c.service.status()
        served, _ = _served(c.url)
    assert all(r["rounds"] == 3 for r in results.values())
    for i in range(2):
        mine = dict(read_tensors(iter_file(tmp_path / f"p{i}" / "final.safetensors")))
        _assert_bitwise(mine, served, f"p{i}")
    newest = status["recent_rounds"][:2]  # (small adapters: the body's header is a large share)
    assert all(r["vs_fp32_out"] and r["vs_fp32_out"] > 1.5 for r in newest), newest


def test_streaming_fragments_come_down_as_their_own_deltas(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Streaming DiLoCo (K = 2, τ = 1, α = 0.5): each round's delta holds its fragment's tensors;
    the fragments' engines share the served model, every delta's result matches the version's
    digest (no whole download after the join), each round brings down fewer bytes than its
    fragment in fp32, and the run ends on the served model bit for bit."""
    from tests.helpers.runs import FRAGMENTS, initial_model
    from tests.helpers.streaming import Fixed, streaming_config

    cfg = streaming_config(6, 4, {"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5},
                           train={"download_compression": "int8", "compression_block": 8})
    tasks = [Fixed(rows=16, seed=40 + i) for i in range(2)]
    with caplog.at_level("INFO", logger="fedtrain.participant"), \
            BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        runners = run_all([TinyParticipant(c.url, f"p{i}", task) for i, task in enumerate(tasks)])
        recent = c.service.status()["recent_rounds"]
        served, _ = _served(c.url)
    assert not [r.message for r in caplog.records if "whole" in r.message]  # every delta checked out
    for r in runners:  # the run's end lands on the global model: from the served copy, bit for bit
        _assert_bitwise(r.weights, served, str(r.name))
    model = initial_model().state_dict()
    for r in runners:
        assert r.fed is not None and r.fed.round == 6 and [h["fragment"] for h in r.fed.history] == [0, 1] * 3
        for rec in r.fed.history:
            prefix = ("lin.", "head.")[rec["fragment"]]
            fp32 = sum(4 * t.numel() for n, t in model.items() if n.startswith(prefix))
            assert 0 < rec["bytes_down"] < fp32, (rec["fragment"], rec["bytes_down"], fp32)
    assert all(r["vs_fp32_out"] for r in recent)


def test_a_live_change_turns_compressed_downloads_on_at_a_round_boundary(tmp_path: Path) -> None:
    from tests.helpers.api import client, commit_round_0, put

    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=0)) as c, client(c, ATOKEN) as admin:
        assert admin.post("/v1/join", json={"name": "a"}).status_code == 200
        assert admin.get("/v1/model/delta", params={"from": 0}).json()["error"]["code"] == "no_delta"
        r = admin.put("/v1/config", json={"changes": {"train": {"download_compression": "int8"}}})
        assert r.status_code == 200, r.text
        commit_round_0(c, admin)  # merged whole; the change comes into force for round 1
        gone = admin.get("/v1/model/delta", params={"from": 0})
        assert gone.status_code == 409 and gone.json()["error"]["code"] == "delta_unavailable"
        step = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
        assert put(admin, 1, "a", step).status_code == 200
        admin.get("/v1/rounds/1", params={"wait": 10})
        delta = admin.get("/v1/model/delta", params={"from": 1})
        assert delta.status_code == 200 and delta.headers["x-fedtrain-version"] == "2"


def test_central_dp_composes_with_compressed_downloads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Central DP noises the outer step; the delta and the residual are computed from the noised
    step alone (post-processing), so both participants still end on the served model bit for
    bit, the downloads after the join are deltas, and ε is dp-accounting's figure for the rounds
    merged, as without compression. The coordinator read P_r back from its file at every merge
    (no copy of the model in memory)."""
    dpa = pytest.importorskip("dp_accounting")
    sigma, delta, rounds = 0.5, 1e-5, 2
    cfg = tiny_config(rounds=rounds, min_participants=2, train=TRAIN, outer=OUTER,
                      privacy={"clip_norm": 5.0, "noise_multiplier": sigma, "delta": delta})
    with caplog.at_level("INFO", logger="fedtrain.coordinator"), \
            BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c:
        ps = run_all(TinyParticipant(c.url, f"p{i}", _task(i)) for i in range(2))
        status = c.service.status()
        served, _ = _served(c.url)
    assert not [r.message for r in caplog.records if "copied in memory" in r.message]
    fp32 = sum(4 * t.numel() for t in served.values())
    for p in ps:
        assert p.fed is not None and p.fed.round == rounds
        _assert_bitwise(p.weights, served, str(p.name))
        assert all(0 < rec["bytes_down"] < fp32 * 0.2 for rec in p.fed.history)
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(sigma), rounds)
    assert status["privacy"]["rounds"] == rounds
    assert status["privacy"]["epsilon"] == pytest.approx(float(acc.get_epsilon(delta)), rel=1e-6)
