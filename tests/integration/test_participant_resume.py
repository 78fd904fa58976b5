"""A participant killed (SIGKILL) and restarted resumes its data position and inner optimizer
state from its run directory, and rejoins at the coordinator's current round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import iter_file, read_tensors
from tests.helpers import zygote
from tests.helpers.config import PTOKEN, tiny_config

H, ROUNDS = 5, 5


def start(url: str, run_dir: Path) -> subprocess.Popen:
    argv = ["participant", "--coordinator", url, "--data", "stdlib:0/2", "--name", "a", "--run-dir", str(run_dir)]
    return zygote.popen(
        [sys.executable, "-m", "fedtrain", *argv],
        env={**os.environ, "FEDTRAIN_TOKEN": PTOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def saved(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoint" / "state.json").read_text())


def optimizer_step(run_dir: Path) -> float:
    record = saved(run_dir)
    tensors = dict(read_tensors(iter_file(run_dir / "checkpoint" / record["optimizer"]["file"])))
    return float(tensors["state/0/step"])


def test_killed_participant_resumes_where_it_was(tmp_path: Path) -> None:
    run_dir = tmp_path / "a"
    cfg = tiny_config(rounds=ROUNDS, train={"sync_every": H})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        first = start(c.url, run_dir)
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint" / "state.json").is_file() or saved(run_dir)["round"] < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
        before = saved(run_dir)
        assert before["steps"] == before["round"] * H
        assert before["user_state"]["data"]["batches"] == before["steps"]
        assert optimizer_step(run_dir) == before["steps"]
        rejoin_round = c.service.version  # the only participant is gone: the run waits at this round

        second = start(c.url, run_dir)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err[-3000:]
        assert c.service.finished
        events = [e["message"] for e in c.service.event_log(1000)]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from_round"] == before["round"]
    assert f"joined as a at round {rejoin_round}" in err
    assert f"a rejoined at round {rejoin_round}" in " ".join(events)
    new_steps = (ROUNDS - rejoin_round) * H
    assert summary["steps"] == before["steps"] + new_steps  # counters carried over
    after = saved(run_dir)
    assert after["round"] == ROUNDS
    # the data stream went on from the saved position, and AdamW's step count too (not from zero)
    assert after["user_state"]["data"]["batches"] == before["steps"] + new_steps
    assert optimizer_step(run_dir) == before["steps"] + new_steps
