"""DcpCheckpoint on one rank (an in-process gloo group of 1, FSDP2 on a 1-rank mesh): the optimizer
state round-trips exactly, the files are safetensors and JSON only, and a checkpoint cut off
mid-write is never loaded while the previous one is kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fedtrain import faults
from fedtrain.errors import StateError
from fedtrain.participant.local.dcp_checkpoint import DcpCheckpoint
from fedtrain.participant.ranks.shards import local_tensor
from tests.helpers.dcp import gloo_of_one, sharded, train


@pytest.fixture
def one_rank() -> Iterator[None]:
    with gloo_of_one():
        yield


def state_of(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: local_tensor(v).clone() for k, v in opt.state[p].items()} for g in opt.param_groups
            for p in g["params"]]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.usefixtures("one_rank")
def test_the_optimizer_state_counters_and_user_state_round_trip(tmp_path: Path) -> None:
    model, opt = sharded()
    train(model, opt, 3)
    ck = DcpCheckpoint(tmp_path / "dcp", model)
    assert ck.load(opt) is None  # nothing yet
    ck.save(round_=2, optimizer=opt, steps=3, tokens=48, user_state={"data": {"seed": 1, "batches": 3}})
    model2, opt2 = sharded()
    for group in opt2.param_groups:
        group["weight_decay"] = 0.0
    record = DcpCheckpoint(tmp_path / "dcp", model2).load(opt2)
    assert record == {"round": 2, "steps": 3, "tokens": 48, "world_size": 1,
                      "user_state": {"data": {"seed": 1, "batches": 3}}}
    assert same(state_of(opt2), state_of(opt))
    assert float(next(iter(opt2.state.values()))["step"]) == 3
    assert opt2.param_groups[0]["weight_decay"] == 0.05 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    # no pickle anywhere: the tensors are safetensors (their metadata the JSON headers), the rest JSON
    files = [p for p in (tmp_path / "dcp").rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files), files


@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_cut_off_mid_write_is_never_loaded_and_the_previous_one_is_kept(tmp_path: Path) -> None:
    model, opt = sharded()
    ck = DcpCheckpoint(tmp_path / "dcp", model)
    train(model, opt, 2)
    ck.save(round_=1, optimizer=opt, steps=2)
    at_round_1 = state_of(opt)
    train(model, opt, 2, seed=1)
    with faults.inject("participant.checkpoint", "raise"), pytest.raises(StateError, match="InjectedFault"):
        ck.save(round_=2, optimizer=opt, steps=4)  # every shard written, state.json not yet
    assert (tmp_path / "dcp" / ".partial-2" / "optimizer").is_dir()
    assert ck.latest() == tmp_path / "dcp" / "round-1"

    model2, opt2 = sharded()
    record = DcpCheckpoint(tmp_path / "dcp", model2).load(opt2)
    assert record is not None and record["round"] == 1 and record["steps"] == 2
    assert same(state_of(opt2), at_round_1) and not same(state_of(opt2), state_of(opt))

    ck.save(round_=3, optimizer=opt, steps=6)  # the next complete save clears the rest
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["round-3"]


@pytest.mark.usefixtures("one_rank")
def test_round_directories_without_a_complete_state_are_skipped(tmp_path: Path) -> None:
    model, opt = sharded()
    ck = DcpCheckpoint(tmp_path / "dcp", model)
    train(model, opt, 1)
    ck.save(round_=1, optimizer=opt, steps=1)
    good = tmp_path / "dcp" / "round-1"
    no_state = tmp_path / "dcp" / "round-7"
    (no_state / "optimizer").mkdir(parents=True)
    truncated = tmp_path / "dcp" / "round-5"
    (truncated / "optimizer").mkdir(parents=True)
    (truncated / "state.json").write_text((good / "state.json").read_text())
    for shard in (good / "optimizer").iterdir():
        (truncated / "optimizer" / shard.name).write_bytes(shard.read_bytes()[:-10])
    assert ck.latest() == good
    record = ck.load(opt)
    assert record is not None and record["round"] == 1


@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    model, opt = sharded()
    train(model, opt, 1)
    DcpCheckpoint(tmp_path / "dcp", model).save(round_=1, optimizer=opt, steps=1)
    other, other_opt = sharded(n_layer=2)
    with pytest.raises(StateError, match="cannot be restored"):
        DcpCheckpoint(tmp_path / "dcp", other).load(other_opt)


def test_outside_torch_distributed_it_says_so(tmp_path: Path) -> None:
    from fedtrain.errors import FedtrainError

    with pytest.raises(FedtrainError, match="torchrun"):
        DcpCheckpoint(tmp_path, nn.Linear(2, 2))
