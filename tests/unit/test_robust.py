"""Robust aggregation: clipping, median and trimmed mean against naive references, outliers,
and the spool-backed aggregation that reads one tensor at a time."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtrain.config import OuterConfig, RunConfig
from fedtrain.coordinator.intake import spool as spool_mod
from fedtrain.coordinator.intake.spool import RoundSpool, update_norm_of_file
from fedtrain.coordinator.policy import keeps_every_update
from fedtrain.errors import MergeError
from fedtrain.merge import RunningSum, weighted_mean
from fedtrain.merge.robust import (
    aggregate,
    aggregate_tensor,
    clip_by_norm,
    clip_scale,
    norm_outliers,
    trimmed_count,
    update_norm,
)
from fedtrain.wire import write_file
from fedtrain.wire.compress import compress


def deltas(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)} for _ in range(k)]


def test_norm_and_clip() -> None:
    d = {"x": torch.tensor([3.0, 0.0]), "y": torch.tensor([[4.0]])}
    assert update_norm(d.values()) == pytest.approx(5.0)
    clipped, scale = clip_by_norm(d, 1.0)
    assert scale == pytest.approx(0.2) and update_norm(clipped.values()) == pytest.approx(1.0)
    assert clip_scale(0.5, 1.0) == 1.0 and clip_scale(10.0, None) == 1.0
    with pytest.raises(MergeError):
        clip_scale(float("inf"), 1.0)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_median_matches_numpy(k: int) -> None:
    ds = deltas(k, seed=k)
    got = aggregate(ds, "median")
    for name in ds[0]:
        ref = np.median(np.stack([d[name].numpy() for d in ds]), axis=0)
        np.testing.assert_allclose(got[name].numpy(), ref, rtol=1e-6)


@pytest.mark.parametrize("k,trim", [(5, 0.2), (10, 0.1), (10, 0.25), (4, 0.0), (3, 0.49)])
def test_trimmed_mean_matches_naive(k: int, trim: float) -> None:
    ds = deltas(k, seed=10 + k)
    got = aggregate(ds, "trimmed_mean", trim)
    cut = trimmed_count(k, trim)
    for name in ds[0]:
        x = np.sort(np.stack([d[name].numpy() for d in ds]), axis=0)
        ref = x[cut : k - cut].mean(axis=0)
        np.testing.assert_allclose(got[name].numpy(), ref, rtol=1e-5, atol=1e-6)
    if trim == 0.0:
        mean = weighted_mean(ds, [1.0] * k)
        for name in ds[0]:
            torch.testing.assert_close(got[name], mean[name])


def test_median_resists_one_huge_update() -> None:
    ds = deltas(5)
    ds[0] = {n: t * 1e6 for n, t in ds[0].items()}
    med = aggregate(ds, "median")
    mean = aggregate(ds, "mean")
    assert float(med["a"].abs().max()) < 10 < float(mean["a"].abs().max())


def test_aggregate_tensor_refuses_mismatch() -> None:
    with pytest.raises(MergeError):
        aggregate_tensor([torch.zeros(2), torch.zeros(3)], "median")
    with pytest.raises(MergeError):
        aggregate_tensor([], "median")
    with pytest.raises(MergeError):
        aggregate_tensor([torch.zeros(2)], "mode")  # type: ignore[arg-type]


def test_norm_outliers() -> None:
    assert norm_outliers({"a": 1.0, "b": 100.0}, 3.0) == {}  # two updates: no telling which is odd
    out = norm_outliers({"a": 1.0, "b": 1.2, "c": 0.9, "d": 50.0}, 3.0)
    assert list(out) == ["d"] and "median norm" in out["d"]
    assert norm_outliers({"a": 1.0, "b": 1.2, "c": 0.9, "d": 50.0}, None) == {}
    assert norm_outliers({"a": 1.0, "b": 2.9, "c": 1.0}, 3.0) == {}


def _spool(tmp_path: Path, ds: list[dict[str, torch.Tensor]], scheme: str = "none") -> RoundSpool:
    rs = RoundSpool(tmp_path / "spool")
    for i, d in enumerate(ds):
        tensors, meta = compress(d, scheme)
        src = tmp_path / f"up{i}.safetensors"
        write_file(src, tensors, meta)
        norm = update_norm_of_file(src, {n: torch.float32 for n in d})
        rs.keep(f"p{i}", src, 0, float(i + 1), norm)
    return rs


@pytest.mark.parametrize("method", ["median", "trimmed_mean"])
def test_spool_aggregation_matches_in_memory(tmp_path: Path, method: str) -> None:
    ds = deltas(5, seed=3)
    rs = _spool(tmp_path, ds)
    acc = RunningSum({n: t for n, t in ds[0].items()})
    outer = OuterConfig(aggregator=method, trim_fraction=0.2)
    assert keeps_every_update(RunConfig(outer=outer))[0]
    assert rs.aggregate_into(acc, outer, {n: torch.float32 for n in ds[0]}) == {}
    want = aggregate(ds, method, 0.2)
    got = acc.mean()
    for n in want:
        torch.testing.assert_close(got[n], want[n])
    rs.clear()
    assert not list((tmp_path / "spool").rglob("*.safetensors"))


def test_spool_mean_with_outlier_and_clip(tmp_path: Path) -> None:
    ds = deltas(4, seed=5)
    ds[3] = {n: t * 1000 for n, t in ds[3].items()}
    rs = _spool(tmp_path, ds)
    norms = [update_norm(d.values()) for d in ds]
    acc = RunningSum({n: t for n, t in ds[0].items()})
    outer = OuterConfig(outlier_factor=5.0, clip_norm=min(norms[:3]))
    rejected = rs.aggregate_into(acc, outer, {n: torch.float32 for n in ds[0]})
    assert list(rejected) == ["p3"]
    clipped = [clip_by_norm(d, outer.clip_norm)[0] for d in ds[:3]]
    want = weighted_mean(clipped, [1.0, 2.0, 3.0])
    got = acc.mean()
    for n in want:
        torch.testing.assert_close(got[n], want[n])


def test_spool_reads_compressed_updates(tmp_path: Path) -> None:
    ds = deltas(3, seed=7)
    rs = _spool(tmp_path, ds, scheme="int8")
    acc = RunningSum({n: t for n, t in ds[0].items()})
    rs.aggregate_into(acc, OuterConfig(aggregator="median"), {n: torch.float32 for n in ds[0]})
    want = aggregate(ds, "median")
    got = acc.mean()
    for n in want:  # int8 quantisation error only
        assert float((got[n] - want[n]).abs().max()) < 0.05


def test_spool_aggregation_holds_one_tensor_name_at_a_time(tmp_path: Path, monkeypatch) -> None:
    ds = [{f"t{j}": torch.full((8,), float(i + j)) for j in range(6)} for i in range(3)]
    rs = _spool(tmp_path, ds)
    names_in_flight: list[set[str]] = []
    real = spool_mod._tensor

    def spy(f, meta, name, dtype):
        names_in_flight.append({name})
        return real(f, meta, name, dtype)

    monkeypatch.setattr(spool_mod, "_tensor", spy)
    seen: list[str] = []
    real_agg = spool_mod.aggregate_tensor

    def agg(stack, method, trim):
        seen.append(names_in_flight[-1].pop())
        assert len(stack) == 3  # k tensors of one name, never a whole update
        return real_agg(stack, method, trim)

    monkeypatch.setattr(spool_mod, "aggregate_tensor", agg)
    acc = RunningSum(ds[0])
    rs.aggregate_into(acc, OuterConfig(aggregator="median"), {n: torch.float32 for n in ds[0]})
    assert seen == [f"t{j}" for j in range(6)]
    assert math.isclose(float(acc.mean()["t2"][0]), 3.0)
