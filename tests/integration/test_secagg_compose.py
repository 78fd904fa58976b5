"""Secure aggregation composed with the rest of fedtrain, over loopback: LoRA (only the adapters
are masked and summed; the frozen base never travels), balanced rounds (each site's H differs and
its claim is the tokens it trained) and compressed downloads (the participant takes each new
version as a delta and ends on the served model bit for bit)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import Participant
from fedtrain.recipes import build_model
from fedtrain.wire import iter_file, read_tensors
from tests.helpers.api import client
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.runs import LLAMA, run_two
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, run_all

pytest.importorskip("cryptography")

SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": 4, "secagg_range": 0.5}
RING_BYTES = 2  # N ≤ 4 at int8 precision: the 2^16 ring
BODY_SLACK = 4096  # a safetensors header and the secagg metadata


def test_with_lora_only_the_adapters_are_masked_and_summed(tmp_path: Path) -> None:
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = {"recipe": "hf", "hf": {"config": LLAMA}, "lora": lora}
    cfg = tiny_config(model=model, rounds=2, train={"sync_every": 3, "lr": 1e-2}, min_participants=2,
                      privacy=SECAGG)
    full = build_model(cfg.model, seed=cfg.seed)
    adapters = {n: p.detach().clone() for n, p in full.named_parameters() if p.requires_grad}
    n_adapter = sum(t.numel() for t in adapters.values())
    n_all = sum(p.numel() for p in full.parameters())
    assert n_all > 10 * n_adapter  # a whole-model upload would be far larger than what is allowed below
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        assert set(c.service.inspect().weights) == set(adapters)  # it holds and merges adapters only
        results = run_two(c.url, tmp_path)
        status = c.service.status()
        history = c.service.round_history(10)
        final = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        assert c.service.finished
    assert status["secure_aggregation"]["refused_attempts"] == 0
    assert len(history) == 2
    for r in history:  # every upload is the adapters in the ring, nothing of the base
        assert r["n_submissions"] == 2, r
        assert 2 * RING_BYTES * n_adapter <= r["bytes_in"] < 2 * (RING_BYTES * n_adapter + BODY_SLACK), r
    for r in results.values():
        assert r["rounds"] == 2
    assert any(not torch.equal(final[n], adapters[n]) for n in adapters)  # the masked rounds moved them
    stored = dict(read_tensors(iter_file(tmp_path / "state" / "checkpoints" / "global-000002.safetensors")))
    assert set(stored) == set(adapters)
    for i in range(2):  # each participant ends on the global adapters (the unmasked aggregate)
        mine = dict(read_tensors(iter_file(tmp_path / f"p{i}" / "final.safetensors")))
        assert all(torch.equal(mine[n], final[n]) for n in final)


def test_with_balanced_rounds_each_site_claims_the_tokens_of_its_own_steps(tmp_path: Path) -> None:
    rounds, rows = 3, 16
    cfg = tiny_config(rounds=rounds, train={"sync_every": 6}, schedule={"mode": "balanced"},
                      heartbeat_interval_s=0.2, privacy=SECAGG)
    speeds = {"fast": 1.0, "slow": 0.25}
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, Small())) as c:
        ps = run_all(TinyParticipant(c.url, name, Regression(rows=rows, seed=i), speed=speed, step_sleep_s=0.03)
                     for i, (name, speed) in enumerate(speeds.items()))
        status = c.service.status()
    assert status["secure_aggregation"]["refused_attempts"] == 0
    told = {str(p.name): [r["sync_every"] for r in p.fed.history] for p in ps if p.fed is not None}
    assert all(len(h) == rounds for h in told.values()), told
    assert any(told["slow"][r] < told["fast"][r] for r in range(1, rounds)), told  # H differs by speed
    for p in ps:
        assert p.fed is not None and p.fed.steps == sum(told[str(p.name)])
        assert p.losses[-1] < p.losses[0] / 2, (p.name, p.losses[0], p.losses[-1])
    by_round = {r["round"]: {s["participant_id"]: s["tokens"] for s in r["submissions"]}
                for r in status["recent_rounds"]}
    assert sorted(by_round) == list(range(rounds))
    for r, tokens in by_round.items():  # both masked in every round, each weighted by the tokens it trained
        assert tokens == {name: told[name][r] * rows for name in speeds}, (r, tokens)


WIDE = functools.partial(Small, width=1024)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_with_compressed_downloads_participants_take_deltas_and_end_on_the_served_model(
        tmp_path: Path, overlap: bool) -> None:
    """Uploads are masked (the 2^16 ring; topk uploads cannot be masked), downloads are topk deltas
    of the unmasked aggregate's merge. In the blocking sync each participant ends on the served
    model bit for bit; in the overlapped one (`exchange_masked`, on the worker thread) it ends on
    the served model plus the steps it trained meanwhile, so there the download's size says it."""
    train = {"sync_every": 4, "download_compression": "topk", "download_topk_density": 0.1, "overlap": overlap}
    cfg = tiny_config(rounds=3, min_participants=2, train=train, privacy=SECAGG, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c:
        ps = run_all(TinyParticipant(c.url, f"p{i}", Regression(rows=16, seed=i, model=WIDE, lr=0.002))
                     for i in range(2))
        status = c.service.status()
        r = httpx.get(f"{c.url}/v1/model", headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
        served = dict(read_tensors(iter([r.content])))
    assert status["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in served.values())
    for p in ps:
        assert p.fed is not None and p.fed.round == 3
        assert set(p.weights) == set(served)
        for n, t in served.items():
            assert overlap or torch.equal(p.weights[n].view(torch.int32), t.view(torch.int32)), (p.name, n)
        downs = [rec["bytes_down"] for rec in p.fed.history]  # after the join's whole model: deltas
        assert len(downs) == 3, p.fed.history
        assert all(0 < d < 4 * params * 0.2 for d in downs), (downs, params)
    rounds = status["recent_rounds"]
    assert len(rounds) == 3
    for rec in rounds:
        assert rec["n_submissions"] == 2 and rec["bytes_in"] < 2 * (RING_BYTES * params + BODY_SLACK), rec
        assert rec["bytes_out"] and rec["vs_fp32_out"] > 3, rec


def test_a_live_change_to_compressed_downloads_reaches_the_overlapped_masked_exchange(tmp_path: Path) -> None:
    """The overlapped masked exchange (`exchange_masked`, on the sync worker) asks for deltas once
    train.download_compression is switched on mid-run, as the plain exchange does: the rounds
    before the change download the whole model, the last ones a delta."""
    rounds = 5
    cfg = tiny_config(rounds=rounds, min_participants=2, train={"sync_every": 4, "overlap": True}, privacy=SECAGG,
                      outer={"algorithm": "fedavg"})  # (topk downloads, set live, need no momentum)
    changed = threading.Event()
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c, \
            client(c, ATOKEN) as admin:

        def switch_on(fed: Participant, _loss: float) -> None:
            if fed.round == 1 and not changed.is_set():
                changed.set()
                r = admin.put("/v1/config", json={"changes": {"train": {"download_compression": "topk",
                                                                          "download_topk_density": 0.1}}})
                assert r.status_code == 200, r.text

        ps = run_all([TinyParticipant(c.url, "p0", Regression(rows=16, seed=0, model=WIDE, lr=0.002),
                                      on_step=switch_on),
                      TinyParticipant(c.url, "p1", Regression(rows=16, seed=1, model=WIDE, lr=0.002))])
        served = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    assert changed.is_set()
    fp32 = sum(4 * t.numel() for t in served.values())
    for p in ps:
        assert p.fed is not None
        downs = [rec["bytes_down"] for rec in p.fed.history]
        assert len(downs) == rounds, p.fed.history
        assert downs[0] >= fp32, downs  # whole before the change
        assert 0 < downs[-1] < fp32 * 0.2, downs  # a delta after it
