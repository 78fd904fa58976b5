"""The upload residual in a participant's local checkpoint (#32): it round-trips bit for bit,
with the rest, atomically; a damaged or missing file is logged and reads as none (the error
feedback starts from zero); a residual that does not fit the model (a checkpoint of another
model, a wrong shape, non-finite values) is refused whole by the engines, which then hold none."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fedtrain.config import OuterConfig, RunConfig, TrainConfig
from fedtrain.errors import ModelMismatchError
from fedtrain.participant.engine.momentum import LocalMomentum
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.engine.sync_schedule import Exchanges
from fedtrain.participant.local.checkpoint import LocalCheckpoint
from fedtrain.wire.compress import decompress


def _exchanges(fragments: list[list[str]] | None = None) -> Exchanges:
    params = {"a": torch.nn.Parameter(torch.zeros(4, 3)), "b": torch.nn.Parameter(torch.zeros(5))}
    engine = SyncEngine(None, params, who="site")  # type: ignore[arg-type]  # (no call reaches the client)
    engine.prepare({"a": {"dtype": "F32", "shape": [4, 3]}, "b": {"dtype": "F32", "shape": [5]}})
    return Exchanges(engine, fragments)


def test_the_residual_round_trips_with_the_checkpoint_and_old_files_go(tmp_path: Path) -> None:
    ck = LocalCheckpoint(tmp_path)
    residual = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    ck.save(round_=1, optimizer=None, residual={n: t * 2 for n, t in residual.items()})
    ck.save(round_=2, optimizer=None, residual=residual)
    back = ck.load_residual()
    assert back is not None and set(back) == set(residual)
    assert all(torch.equal(back[n], residual[n]) for n in residual)
    assert sorted(p.name for p in tmp_path.glob("residual-*")) == ["residual-2.safetensors"]
    ck.save(round_=3, optimizer=None)  # none now (compression turned off): no file is left
    assert ck.load_residual() is None and not list(tmp_path.glob("residual-*"))


@pytest.mark.parametrize("harm", ["flip", "remove"])
def test_a_damaged_or_missing_residual_reads_as_none_and_is_logged(tmp_path: Path, harm: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    ck = LocalCheckpoint(tmp_path)
    ck.save(round_=0, optimizer=None, residual={"a": torch.ones(4, 3)})
    f = tmp_path / "residual-0.safetensors"
    if harm == "flip":
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="fedtrain.participant"):
        assert ck.load_residual() is None
    assert any("starts from zero" in r.message for r in caplog.records)
    assert ck.load(None) is not None  # the rest of the checkpoint still loads


@pytest.mark.parametrize("fragments", [None, [["a"], ["b"]]], ids=["whole", "fragments"])
def test_the_engines_take_a_residual_that_fits(fragments: list[list[str]] | None) -> None:
    ex = _exchanges(fragments)
    residual = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    ex.restore_upload_residual(residual)
    back = ex.upload_residual()
    assert set(back) == {"a", "b"} and all(torch.equal(back[n], residual[n]) for n in residual)


@pytest.mark.parametrize("bad", [
    {"a": torch.zeros(3, 4)},  # the wrong shape
    {"zzz": torch.zeros(2)},  # a tensor this model does not sync
    {"a": torch.zeros(4, 3, dtype=torch.int32)},  # not a float
    {"b": torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0])},  # not finite
], ids=["shape", "name", "dtype", "nan"])
def test_a_residual_that_does_not_fit_is_refused_whole(bad: dict[str, torch.Tensor]) -> None:
    ex = _exchanges([["a"], ["b"]])
    with pytest.raises(ModelMismatchError):
        ex.restore_upload_residual({"a": torch.ones(4, 3), "b": torch.ones(5), **bad})
    assert ex.upload_residual() == {}


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_engine_compresses_delta_plus_the_decayed_residual(decay: float) -> None:
    """`train.error_feedback_decay` β: the engine sends Δ + β·residual and keeps the rest, so
    what it sent plus what it holds afterwards is Δ + β·(the residual before)."""
    params = {"a": torch.nn.Parameter(torch.zeros(4, 3)), "b": torch.nn.Parameter(torch.zeros(5))}
    engine = SyncEngine(None, params, who="site")  # type: ignore[arg-type]  # (no call reaches the client)
    engine.prepare({"a": {"dtype": "F32", "shape": [4, 3]}, "b": {"dtype": "F32", "shape": [5]}})
    g = torch.Generator().manual_seed(3)
    reference = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    engine.restore(sent=reference)  # the round's reference weights
    with torch.no_grad():
        for p in params.values():
            p.copy_(torch.randn(p.shape, generator=g))
    engine.take_delta()
    delta = {n: reference[n] - p.detach() for n, p in params.items()}
    before = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    engine.restore_upload_residual(before)
    config = RunConfig(train=TrainConfig(compression="topk", topk_density=0.25, topk_chunk=64,
                                         error_feedback_decay=decay), outer=OuterConfig(algorithm="fedavg"))
    body = engine.encode(config)
    tensors = safetensors.torch.load(b"".join(bytes(c) for c in body))
    in_order = [(n, tensors[n]) for n in body.specs]  # (a compressed tensor's parts come first)
    sent = dict(decompress(in_order, body.metadata, shapes={"a": (4, 3), "b": (5,)}))
    after = engine.upload_residual
    for n in params:
        torch.testing.assert_close(sent[n] + after[n], delta[n] + decay * before[n], rtol=0, atol=1e-5)


def test_local_nesterov_with_outer_sgd_is_dilocos_outer_nesterov() -> None:
    """`train.upload_momentum`: each of M participants steps its own Nesterov momentum on its Δ and
    the coordinator takes plain SGD of the mean; with equal weights that is torch's SGD Nesterov
    on the mean Δ (DiLoCo's outer step), round after round."""
    g = torch.Generator().manual_seed(8)
    lr, mu, sites = 0.7, 0.9, 3
    theta_a = torch.nn.Parameter(torch.randn(50, generator=g))
    theta_b = theta_a.detach().clone()
    outer = torch.optim.SGD([theta_a], lr=lr, momentum=mu, nesterov=True)
    local = [LocalMomentum() for _ in range(sites)]
    for _ in range(6):
        deltas = [torch.randn(50, generator=g) for _ in range(sites)]
        theta_a.grad = torch.stack(deltas).mean(0)
        outer.step()
        sent = [m.step({"x": d}, mu, nesterov=True)["x"] for m, d in zip(local, deltas, strict=True)]
        theta_b -= lr * torch.stack(sent).mean(0)
        torch.testing.assert_close(theta_b, theta_a.detach(), rtol=0, atol=1e-5)


def test_the_engine_sends_the_momentum_of_its_deltas() -> None:
    """The engine applies `train.upload_momentum` (Nesterov) before it compresses: two rounds'
    bodies are Δ₁ + μΔ₁, then Δ₂ + μ(μΔ₁ + Δ₂); set back to 0, the next body is Δ₃ itself."""
    params = {"a": torch.nn.Parameter(torch.zeros(4, 3))}
    engine = SyncEngine(None, params, who="site")  # type: ignore[arg-type]  # (no call reaches the client)
    engine.prepare({"a": {"dtype": "F32", "shape": [4, 3]}})
    g = torch.Generator().manual_seed(9)

    def body_of(delta: torch.Tensor, momentum: float) -> torch.Tensor:
        engine.restore(sent={"a": delta.clone()})  # the round's reference; the model holds zeros: Δ = delta
        engine.take_delta()
        config = RunConfig(train=TrainConfig(upload_momentum=momentum), outer=OuterConfig(algorithm="fedavg"))
        body = engine.encode(config)
        return safetensors.torch.load(b"".join(bytes(c) for c in body))["a"]

    d1, d2, d3 = (torch.randn(4, 3, generator=g) for _ in range(3))
    torch.testing.assert_close(body_of(d1, 0.9), d1 + 0.9 * d1)
    torch.testing.assert_close(body_of(d2, 0.9), d2 + 0.9 * (0.9 * d1 + d2))
    torch.testing.assert_close(body_of(d3, 0.0), d3)
