"""Secure aggregation composed with the rest of fedtrain, over loopback: LoRA (only the adapters
are masked and summed; the frozen base never travels), balanced rounds (each site's H differs and
its claim is the tokens it trained) and compressed downloads (the participant takes each new
version as a delta and ends on the served model bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes import build_model
from fedtrain.wire import iter_file, read_tensors
from tests.helpers.config import tiny_config
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
