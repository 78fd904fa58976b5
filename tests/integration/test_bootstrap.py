"""Bootstrapping: any nn.Module through --init-weights, exact mismatch messages, checkpoint pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import ModelMismatchError
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.wire import write_file
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tiny import Regression, Small, init_file, train

__all__ = ["Small", "init_file"]  # imported from here by other tests


def test_any_module_trains_from_init_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Small()
    cfg = tiny_config(rounds=4, train={"sync_every": 5}, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, reference)) as c:
        # a different local init (Small() after the reference): the participant must receive the run's weights
        solo = train(c.url, "solo", Regression(rows=64))
        assert torch.equal(solo.initial["lin.weight"], reference.lin.weight)
        assert solo.fed is not None and solo.fed.round == 4 and len(solo.fed.history) == 4
        model = solo.model
        assert solo.loss() < solo.losses[0]
        assert set(c.service.inspect().weights) == {"lin.weight", "lin.bias", "head.weight", "head.bias"}
        for n, t in c.service.inspect().weights.items():  # FedAvg with one participant: its weights
            assert torch.equal(t, dict(model.named_parameters())[n].detach())
        # pruning keeps the newest keep_checkpoints committed versions only
        assert c.service.inspect().checkpoints.versions() == [2, 3, 4]


def test_mismatched_model_is_told_exactly_what_differs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with pytest.raises(ModelMismatchError) as info:
            with Participant(CoordinatorClient(c.url, PTOKEN), model=Small(width=5), name="wide"):
                pass
        msg = info.value.message
        assert "lin.weight" in msg and "(5, 3)" in msg and "(4, 3)" in msg and "head.weight" in msg
        # refused at the join (#31): no participant that never submits, not even a failed one
        assert c.service.status()["participants"] == []
        assert [e["kind"] for e in c.service.event_log()] == ["run"]


def test_orphan_checkpoint_of_uncommitted_round_is_removed(tmp_path: Path) -> None:
    cfg = tiny_config()
    state = tmp_path / "s"
    with BackgroundCoordinator(state, cfg) as c:
        params = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        ckpt = c.service.inspect().checkpoints
    # a crash between the file rename and the database commit leaves version 1's files behind
    write_file(ckpt.global_path(1), {n: t + 1 for n, t in params.items()})
    write_file(ckpt.outer_path(1), {})
    (ckpt.root / "global-000002.safetensors.tmp123").write_bytes(b"partial")
    with BackgroundCoordinator(state, cfg) as c:
        assert c.service.version == 0
        assert c.service.inspect().checkpoints.versions() == [0]
        # the partial temp file is gone; the orphans are kept only as spares for the next checkpoint
        spares = sorted(p.name for p in c.service.inspect().checkpoints.root.glob("*.tmp*"))
        assert spares == [".spare-1.tmp", ".spare-2.tmp"]
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(t, params[n])


def test_damaged_checkpoint_is_refused_not_loaded(tmp_path: Path) -> None:
    from fedtrain.errors import StateError

    state = tmp_path / "s"
    with BackgroundCoordinator(state, tiny_config()) as c:
        path = c.service.inspect().checkpoints.global_path(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="damaged"):
        BackgroundCoordinator(state, tiny_config())
