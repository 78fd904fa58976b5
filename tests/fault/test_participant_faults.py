"""Faults seen from participants: the coordinator disappears (SIGKILL) and comes back, an
upload is lost or slowed past the deadline, a merge fails; and an outage that never ends
ends the participant in bounded time. Training never stops for a transient error."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import CoordinatorUnavailable
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.participant.engine.outage import OutagePolicy
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, run_all

FAST_OUTAGE = OutagePolicy(budget_s=90.0, attempt_s=1.0, backoff_initial_s=0.2, backoff_max_s=1.0)


def runner(url: str, name: str, outage: OutagePolicy = FAST_OUTAGE) -> TinyParticipant:
    """One participant training `Small` on a fixed regression task (seeded by its name)."""
    task = Regression(rows=16, seed=sum(map(ord, name)))
    return TinyParticipant(url, name, task, retry=RetryPolicy(max_elapsed_s=30), outage=outage, step_sleep_s=0.01)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_participants_train_through_a_coordinator_outage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(rounds=6, train={"sync_every": 3}, outer={"algorithm": "fedavg"}, heartbeat_interval_s=0.5)
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    init = init_file(tmp_path, Small())
    state, log, port = tmp_path / "state", tmp_path / "coordinator.log", free_port()
    url = f"http://127.0.0.1:{port}"

    def launch():
        return start_coordinator(cfg_path, state, port, log, "--init-weights", str(init))

    proc = launch()
    runners = [runner(url, f"p{i}") for i in range(2)]
    try:
        for r in runners:
            r.start()
        wait_for(lambda: _round(url) >= 2, 60, "round 2")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        steps = [r.fed.steps for r in runners]
        # training goes on, past a sync point (whose attempt failed: the outage began), and nobody exits
        wait_for(lambda: all(r.fed.steps > before + cfg.train.sync_every or not r.is_alive()
                             for r, before in zip(runners, steps)), 60, "a sync point in the outage")
        for r in runners:
            assert r.is_alive() and r.error is None, r.error
        time.sleep(3.0)  # every outage began before this: each lasts at least this long, however fast the restart
        proc = launch()
        for r in runners:
            r.join(timeout=90)  # fails if it still runs, raises what it raised
        with CoordinatorClient(url, PTOKEN) as client:
            status = client.status()
            version, final = client.download()
    finally:
        proc.kill()
        proc.wait()
    assert status["finished"] and version == 6
    assert sorted(r["round"] for r in status["recent_rounds"]) == list(range(6))
    for r in runners:
        assert r.fed.outages, "the outage was not ridden out"
        assert all(o["seconds"] >= 3.0 for o in r.fed.outages)
        for n, t in final.items():
            assert torch.equal(r.weights[n], t), (r.name, n)


def _round(url: str) -> int:
    import httpx

    try:
        return httpx.get(f"{url}/v1/healthz", timeout=2).json()["current_round"]
    except httpx.TransportError:
        return -1


def _run(c: BackgroundCoordinator, n: int = 2) -> list[TinyParticipant]:
    runners = run_all([runner(c.url, f"p{i}") for i in range(n)], timeout=120)  # none hangs, none raised
    assert c.service.finished
    for r in runners:
        for name, t in c.service.inspect().weights.items():
            assert torch.equal(r.weights[name], t), (r.name, name)
    return runners


def test_lost_upload_is_sent_again(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=3, train={"sync_every": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with faults.inject("participant.upload", "drop", who="p0", round=1) as rule:
            _run(c)
        assert rule.fired == 1
        rounds = {r["round"]: r for r in c.service.round_history()}
        assert rounds[1]["n_submissions"] == 2 and "all 2 active" in rounds[1]["close_reason"]


def test_slow_upload_past_the_deadline_moves_on(tmp_path: Path) -> None:
    # p0's round-1 upload is held 4.5 s: past round 1's 3 s deadline (by 1.5 s), and back before round 2's
    # deadline (1.5 s left), so that p0 takes part in round 2 however loaded the machine is
    cfg = tiny_config(rounds=3, train={"sync_every": 3}, round_timeout_s=3.0)
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with faults.inject("participant.upload", "sleep", seconds=4.5, who="p0", round=1) as rule:
            runners = _run(c)
        assert rule.fired == 1
        rounds = {r["round"]: r for r in c.service.round_history()}
        assert [s["participant_id"] for s in rounds[1]["submissions"]] == ["p1"]
        assert "deadline" in rounds[1]["close_reason"] and "p0" in rounds[1]["close_reason"]
        assert [h["round"] for h in runners[0].fed.history] == [0, 1, 2]  # p0 moved on to round 2


def test_failed_merge_is_redone_from_resent_uploads(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=3, train={"sync_every": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        with faults.inject("merge.before_step", "raise", round=1) as rule:
            _run(c)
        assert rule.fired == 1
        kinds = [e["kind"] for e in c.service.event_log(100)]
        assert "merge_failed" in kinds
        assert sorted(r["round"] for r in c.service.round_history()) == [0, 1, 2]


def test_endless_outage_ends_the_participant_in_bounded_time(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=50, train={"sync_every": 3})
    policy = OutagePolicy(budget_s=3.0, attempt_s=0.5, backoff_initial_s=0.2, backoff_max_s=0.5)
    c = BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())).start()
    p0 = runner(c.url, "p0", outage=policy).start()
    wait_for(lambda: c.service.version >= 1, 60, "round 1")
    c.stop()  # gone for good
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnavailable) as info:
        p0.join(timeout=60)  # an AssertionError instead if it still runs
    assert "unreachable for" in info.value.message
    assert time.monotonic() - t0 < 30
    assert p0.fed is not None and p0.fed.steps > 3 * c.service.version  # it trained on while it waited


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_during_sync_are_ridden_out(tmp_path: Path, status: int) -> None:
    from fedtrain.errors import Refused

    cfg = tiny_config(rounds=3, train={"sync_every": 3})
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small())) as c:
        real = c.service.receive_update
        failures = {"left": 3}

        async def flaky(ident, pid, round_, *args):
            if pid == "p0" and round_ == 1 and failures["left"] > 0:
                failures["left"] -= 1
                if status == 500:
                    raise RuntimeError("an internal error of the coordinator")  # answered as 500 internal
                raise Refused(503, "unavailable", "overloaded, try again")
            return await real(ident, pid, round_, *args)

        c.service.receive_update = flaky  # type: ignore[method-assign]
        _run(c)  # no hang, no error, the run finished, everyone on the global weights
        assert failures["left"] == 0
        # Whether the client's own retries absorbed the errors or the participant rode them
        # out as an outage (that depends on the backoff's jitter), p0's update landed in round 1.
        rounds = {r["round"]: r for r in c.service.round_history()}
        assert rounds[1]["n_submissions"] == 2
