"""Bootstrapping: any nn.Module through --init-weights, exact mismatch messages, checkpoint pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import ModelMismatchError
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.wire import write_file
from tests.conftest import PTOKEN, tiny_config


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(3, width)
        self.head = nn.Linear(width, 1)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(x)))


def init_file(tmp_path: Path, model: nn.Module) -> Path:
    path = tmp_path / "init.safetensors"
    write_file(path, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
    return path


def test_any_module_trains_from_init_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Small()
    cfg = tiny_config(rounds=4, train={"sync_every": 5}, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, reference)) as c:
        model = Small()  # different local init: the participant must receive the run's weights
        x = torch.randn(64, 3)
        y = x.sum(dim=1, keepdim=True)
        with Participant(CoordinatorClient(c.url, PTOKEN), model=model, name="solo") as fed:
            assert torch.equal(model.lin.weight, reference.lin.weight)
            first = None
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            while not fed.finished:
                loss = torch.nn.functional.mse_loss(model(x), y)
                first = first if first is not None else loss.item()
                loss.backward()
                opt.step()
                opt.zero_grad()
                fed.step(tokens=64, loss=loss.item())
            assert fed.round == 4 and len(fed.history) == 4
        assert torch.nn.functional.mse_loss(model(x), y).item() < first
        assert set(c.service.outer.params) == {"lin.weight", "lin.bias", "head.weight", "head.bias"}
        for n, t in c.service.outer.params.items():  # FedAvg with one participant: its weights
            assert torch.equal(t, dict(model.named_parameters())[n].detach())
        # pruning keeps the newest keep_checkpoints committed versions only
        assert c.service.ckpt.versions() == [2, 3, 4]


def test_mismatched_model_is_told_exactly_what_differs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with pytest.raises(ModelMismatchError) as info:
            with Participant(CoordinatorClient(c.url, PTOKEN), model=Small(width=5), name="wide"):
                pass
        msg = info.value.message
        assert "lin.weight" in msg and "(5, 3)" in msg and "(4, 3)" in msg and "head.weight" in msg


def test_orphan_checkpoint_of_uncommitted_round_is_removed(tmp_path: Path) -> None:
    cfg = tiny_config()
    state = tmp_path / "s"
    with BackgroundCoordinator(state, cfg) as c:
        params = {n: t.clone() for n, t in c.service.outer.params.items()}
        ckpt = c.service.ckpt
    # a crash between the file rename and the database commit leaves version 1's files behind
    write_file(ckpt.global_path(1), {n: t + 1 for n, t in params.items()})
    write_file(ckpt.outer_path(1), {})
    (ckpt.root / "global-000002.safetensors.tmp123").write_bytes(b"partial")
    with BackgroundCoordinator(state, cfg) as c:
        assert c.service.version == 0
        assert c.service.ckpt.versions() == [0]
        # the partial temp file is gone; the orphans are kept only as spares for the next checkpoint
        assert sorted(p.name for p in c.service.ckpt.root.glob("*.tmp*")) == [".spare-1.tmp", ".spare-2.tmp"]
        for n, t in c.service.outer.params.items():
            assert torch.equal(t, params[n])


def test_damaged_checkpoint_is_refused_not_loaded(tmp_path: Path) -> None:
    from fedtrain.errors import StateError

    state = tmp_path / "s"
    with BackgroundCoordinator(state, tiny_config()) as c:
        path = c.service.ckpt.global_path(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="damaged"):
        BackgroundCoordinator(state, tiny_config())
