"""Evals around the syncs at the configured cadence, the coordinator's global eval, and `fedtrain status`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fedtrain.cli import main as fedtrain_main
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes.train import run_participant
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tiny import TrainingThread, join_all


def test_eval_cadence_global_eval_and_status_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(
        rounds=4,
        min_participants=2,
        keep_checkpoints=10,  # tiny rounds outrun the evaluator; it skips versions no longer on disk
        eval={"every": 2, "global_data": "stdlib:heldout", "global_batches": 2},
    )
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        join_all(*(TrainingThread(run_participant, c.url, PTOKEN, f"stdlib:{i}/2", name=f"p{i}",
                                  run_dir=tmp_path / f"p{i}").start() for i in range(2)), timeout=120)
        deadline = time.monotonic() + 30
        while not any(m["name"] == "global_eval/loss" and m["round"] == 4 for m in c.service.metrics()):
            assert time.monotonic() < deadline, "the coordinator did not evaluate the final global model"
            time.sleep(0.1)
        metrics = c.service.metrics()
        assert fedtrain_main(["status", "--coordinator", c.url, "--token", PTOKEN]) == 0
        text = capsys.readouterr().out
        assert fedtrain_main(["status", "--coordinator", c.url, "--token", PTOKEN, "--json"]) == 0
        as_json = json.loads(capsys.readouterr().out)

    def rounds_of(name: str, pid: str | None) -> list[int]:
        return sorted(m["round"] for m in metrics if m["name"] == name and m["participant_id"] == pid)

    for pid in ("p0", "p1"):  # every 2nd round and the last one, before and after the sync
        assert rounds_of("eval_before/loss", pid) == [0, 2, 3]
        assert rounds_of("eval_after/ppl", pid) == [0, 2, 3]
        assert rounds_of("train_loss", pid) == [0, 1, 2, 3]
        assert rounds_of("tokens", pid) == [0, 1, 2, 3]
    # the coordinator's eval of the initial model and of the models those rounds produced
    assert rounds_of("global_eval/loss", None) == [0, 1, 3, 4]
    global_loss = {m["round"]: m["value"] for m in metrics if m["name"] == "global_eval/loss"}
    assert global_loss[4] < global_loss[0]
    assert "evals around each sync" in text and "before sync" in text and "global (coord.)" in text
    evals = as_json["evals"]
    assert [(e["round"], e["participant"]) for e in evals] == [(-1, "(initial)")] + [
        (r, p) for r in (0, 2, 3) for p in ("p0", "p1")
    ]
    assert all(e["before"]["loss"] > 0 and e["after"]["loss"] > 0 for e in evals[1:])
    lines = (tmp_path / "p0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 2, 3]
