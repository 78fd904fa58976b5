"""Robust aggregation through the real coordinator: median from spooled files, norm clipping
while streaming, and a norm outlier left out of the round and reported as an event."""

from __future__ import annotations

from pathlib import Path

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.merge.robust import aggregate, clip_by_norm, update_norm
from tests.helpers.api import client, put
from tests.helpers.config import tiny_config


def rand_like(c: BackgroundCoordinator, seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in c.service.inspect().weights.items()}


def close_round(http, r: int) -> dict:
    info = http.get(f"/v1/rounds/{r}", params={"wait": 20}).json()
    assert info["state"] == "closed", info
    return info


def test_median_is_taken_from_spooled_updates(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg", "aggregator": "median"})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abc":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = [rand_like(c, 1), rand_like(c, 2), rand_like(c, 3, scale=1000.0)]  # c is wildly off
        put(http, 0, "a", ds[0])
        put(http, 0, "b", ds[1])
        kept = sorted(p.name for p in (c.service.spool / "round-0").glob("*.safetensors"))
        assert kept == ["a.safetensors", "b.safetensors"]  # on disk until the round closes, not in RAM
        assert c.service.inspect().sum_count == 0
        put(http, 0, "c", ds[2])
        close_round(http, 0)
        assert not list(c.service.spool.rglob("*.safetensors"))
        med = aggregate(ds, "median")
        for n, t in c.service.inspect().weights.items():
            torch.testing.assert_close(t, theta0[n] - med[n])
        weights = {s["participant_id"]: s["weight"] for s in c.service.round_history()[0]["submissions"]}
        assert weights == {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}


def test_norm_outlier_is_left_out_and_reported(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg", "outlier_factor": 3.0})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in "abcd":
            http.post("/v1/join", json={"name": pid})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ds = {pid: rand_like(c, i, scale=100.0 if pid == "d" else 0.01) for i, pid in enumerate("abcd")}
        for pid, d in ds.items():
            assert put(http, 0, pid, d).status_code == 200
        close_round(http, 0)
        for n, t in c.service.inspect().weights.items():
            want = theta0[n] - (ds["a"][n] + ds["b"][n] + ds["c"][n]) / 3
            torch.testing.assert_close(t, want)
        events = [e for e in c.service.event_log(50) if e["kind"] == "reject"]
        assert len(events) == 1 and events[0]["participant_id"] == "d" and "median norm" in events[0]["message"]
        weights = {s["participant_id"]: s["weight"] for s in c.service.round_history()[0]["submissions"]}
        assert weights["d"] == 0.0 and abs(sum(weights.values()) - 1.0) < 1e-9


def test_clip_norm_while_streaming(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg", "clip_norm": 0.5})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        http.post("/v1/join", json={"name": "b"})
        theta0 = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        da, db = rand_like(c, 1, scale=0.001), rand_like(c, 2, scale=1.0)
        assert update_norm(da.values()) < 0.5 < update_norm(db.values())
        put(http, 0, "a", da)
        put(http, 0, "b", db)
        assert not list(c.service.spool.rglob("*.safetensors"))  # folded at once: mean needs no spool
        close_round(http, 0)
        clipped, _ = clip_by_norm(db, 0.5)
        for n, t in c.service.inspect().weights.items():
            torch.testing.assert_close(t, theta0[n] - (da[n] + clipped[n]) / 2)
