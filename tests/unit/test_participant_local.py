"""A participant's local state: checkpoint (safetensors + JSON, no pickle), metrics log, eval cadence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator.global_eval import version_due
from fedtrain.errors import StateError
from fedtrain.participant import Participant
from fedtrain.participant.checkpoint import LocalCheckpoint
from fedtrain.participant.metrics_log import MetricsLog
from fedtrain.recipes import TokenStream
from fedtrain.report import eval_rows, format_evals


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
    fed = Participant("http://127.0.0.1:9", token="t", model=torch.nn.Linear(2, 2))
    fed.config = cfg
    assert [r for r in range(7 if rounds == 0 else rounds) if fed.eval_due(r)] == due
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
