"""A torchrun participant (gloo, CPU) stopped with SIGTERM stops cleanly: every rank ends on
"fedtrain participant: stopped" with no traceback, also while rank 1 sits in a collective
waiting for rank 0's sync; and under `distributed.launch` the launcher does too (under
torch's own `torchrun` the launcher prints torch's SignalException traceback, which no code
of ours runs in)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.torchrun import participant_group

STOPPED = "fedtrain participant: stopped"


def wait_until(group: subprocess.Popen, url: str, ready: str, timeout: float = 120.0) -> None:
    """Until the group is where the test wants to stop it: `ready` is "trained" (a round of
    it committed) or "submitted" (it uploaded to the open round, which cannot close)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {PTOKEN}"}, timeout=10) as http:
        while True:
            s = http.get("/v1/status").json()
            if (s["current_round"] >= 2) if ready == "trained" else ("group" in s["submitted"]):
                return
            assert group.poll() is None and time.monotonic() < deadline, group.communicate()[0][-3000:]
            time.sleep(0.1)


def stop(group: subprocess.Popen) -> str:
    group.send_signal(signal.SIGTERM)
    out, _ = group.communicate(timeout=120)
    return out


def test_sigterm_under_launch_stops_every_rank_and_the_launcher_without_a_traceback(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=0, train={"sync_every": 10})) as c:
        group = participant_group(c.url, "group", via="fedtrain")  # the command a user runs
        try:
            wait_until(group, c.url, "trained")
        finally:
            out = stop(group)
    assert "Traceback" not in out, out[-4000:]
    assert out.count(STOPPED) == 2, out[-4000:]
    assert out.rstrip().splitlines()[-1] == "fedtrain torchrun: stopped (SIGTERM)", out[-4000:]
    assert group.returncode == 130


def test_sigterm_under_torchrun_stops_every_rank_quietly_while_one_waits_in_a_collective(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    cfg = tiny_config(rounds=0, min_participants=2, round_timeout_s=600.0)  # round 0 stays open: rank 0 waits
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = participant_group(c.url, "group", launch_args=["--log-dir", str(logs), "--redirects", "3"])
        try:
            wait_until(group, c.url, "submitted")
            time.sleep(1.0)  # rank 0 long-polls the round, rank 1 waits for its outcome in a broadcast
        finally:
            out = stop(group)
    ranks = sorted(logs.rglob("stderr.log"))
    assert len(ranks) == 2, (ranks, out[-3000:])
    for f in ranks:  # each rank's own stderr (the launcher's output is torch's)
        text = f.read_text()
        assert "Traceback" not in text, (f, text[-3000:])
        assert text.rstrip().splitlines()[-1] == STOPPED, (f, text[-3000:])
