"""The coordinator killed (SIGKILL) at each named point of the upload, merge, checkpoint and
commit path, then restarted: the state is the last committed round, a partial checkpoint is
never loaded, and the open round's uploads can be sent again.

Each restart both checks the recovery from the previous crash and arms the next point, so
the points are chained through one state directory: crashes on top of crashes. The chain
runs twice: in-process, where the point raises `InjectedCrash` (a BaseException: nothing
after the point runs, nothing catches it) and the coordinator is then stopped and opened
afresh; and with real processes killed by SIGKILL at the point via FEDTRAIN_FAULTS="<point>:kill",
where the files a dying process leaves behind (a temp file, a half-written checkpoint) are real
(in the default run at the points that leave files, `ON_DISK`; at every point with -m slow).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.coordinator import BackgroundCoordinator, Tokens
from fedtrain.coordinator.model.checkpoints import SPARES, CheckpointDir
from fedtrain.coordinator.state.store import Store
from tests.helpers.api import delta, download, upload
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator

# (point, does the round commit before the process dies?)
CHAIN = [
    ("upload.streaming", False),
    ("upload.received", False),
    ("merge.before_step", False),
    ("checkpoint.after_outer_write", False),
    ("file.before_rename", False),
    ("checkpoint.after_global_write", False),
    ("commit.before_db", False),
    ("commit.after_db", True),
]
# With real processes, the default run kills under an upload (first: the initial checkpoint is
# written by then, so the next points fire in a round and not at the start) and at the points whose
# leftovers on disk differ from the in-process chain's (a half-written checkpoint, a temp file, a
# checkpoint the database does not know); the whole chain runs with -m slow. Each process start
# costs seconds of CPU.
ON_DISK = {"upload.received", "checkpoint.after_outer_write", "file.before_rename", "commit.before_db",
           "commit.after_db"}


class Processes:
    """Coordinators as processes, killed with SIGKILL at the point."""

    def __init__(self, tmp_path: Path, cfg_path: Path) -> None:
        self.state, self.cfg_path, self.log = tmp_path / "state", cfg_path, tmp_path / "coordinator.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, point: str) -> str:
        faults_env = {"FEDTRAIN_FAULTS": f"{point}:kill" if point else ""}
        self.proc = start_coordinator(self.cfg_path, self.state, self.port, self.log, env=faults_env)
        return f"http://127.0.0.1:{self.port}"

    def wait_dead(self, point: str) -> None:
        assert self.proc is not None
        assert self.proc.wait(timeout=60) == -signal.SIGKILL, f"{point} did not kill: {self.log.read_text()[-2000:]}"

    def stop(self) -> None:
        if self.proc is not None:
            stop_coordinator(self.proc)


class InProcess:
    """Coordinators on a thread; the point raises InjectedCrash, then the coordinator is stopped."""

    def __init__(self, tmp_path: Path, cfg_path: Path) -> None:
        self.state, self.cfg = tmp_path / "state", tiny_config().model_validate_json(cfg_path.read_text())
        self.bg: BackgroundCoordinator | None = None
        self.rule: faults.Rule | None = None

    def start(self, point: str) -> str:
        self.rule = faults.arm(faults.Rule(point, "crash")) if point else None
        self.bg = BackgroundCoordinator(self.state, self.cfg, tokens=Tokens([PTOKEN], "admin")).start()
        return self.bg.url

    def wait_dead(self, point: str) -> None:
        deadline = time.monotonic() + 30
        while self.rule is not None and self.rule.fired == 0:
            assert time.monotonic() < deadline, f"{point} never fired"
            time.sleep(0.02)
        time.sleep(0.2)  # let the crash unwind
        self.stop()

    def stop(self) -> None:
        faults.disarm()
        if self.bg is not None:
            self.bg.stop()
            self.bg.service.store.close()
            self.bg = None


def check_disk(state: Path, committed: int) -> None:
    """What a restart must find: every kept checkpoint loads against its digest, nothing newer is kept."""
    store = Store(state / "run.db")
    try:
        assert store.committed_version() == committed
        ckpt = CheckpointDir(state / "checkpoints")
        kept = ckpt.versions()
        assert kept and max(kept) == committed, kept
        for v in kept:
            ckpt.load_global(v, store.get_meta(f"digest/{v}"))
            ckpt.load_outer(v)
        temp = list(ckpt.root.glob("*.tmp*"))  # only spares: pruned files the next checkpoint writes over
        assert all(p.name.startswith(".spare-") for p in temp) and len(temp) <= SPARES, temp
    finally:
        store.close()


def run_chain(tmp_path: Path, runner_cls: type, publish_first: bool = False, points: set[str] | None = None) -> None:
    cfg = tiny_config(rounds=20, outer={"algorithm": "fedavg"}, keep_checkpoints=20, publish_first=publish_first)
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    state = tmp_path / "state"
    runner = runner_cls(tmp_path, cfg_path)
    headers = {"Authorization": f"Bearer {PTOKEN}"}
    committed, theta = 0, None
    chain = [(p, c) for p, c in CHAIN if points is None or p in points]
    for point, commits in [*chain, ("", True)]:  # the last run has no fault: it must finish a round
        url = runner.start(point)
        # ... and a restart never loads a partial checkpoint: only what the database committed counts
        check_disk(state, committed)
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                version, params = download(http)
                assert version == committed, (point, version, committed)  # the last committed round, no more
                if theta is not None:  # what was committed (or computed for it) before the crash
                    for n, t in params.items():
                        torch.testing.assert_close(t, theta[n], rtol=0, atol=1e-6, msg=f"after {point}")
                events = [e["message"] for e in http.get("/v1/events", params={"limit": 5}).json()["events"]]
                assert any(m.startswith(f"resumed at round {committed}") for m in events) or committed == 0
                for pid in ("a", "b"):
                    assert http.post("/v1/join", json={"name": pid}).status_code == 200
                da, db = delta(params, 0, committed), delta(params, 1, committed)
                # the open round's uploads are sent (again, after a crash) and accepted afresh
                if point.startswith("upload."):  # the coordinator dies under the first upload
                    try:
                        r = upload(http, committed, "a", da)
                        assert r.status_code >= 500, r.text
                    except httpx.TransportError:
                        pass
                else:
                    first = upload(http, committed, "a", da)
                    assert first.json() == {"accepted": True, "duplicate": False, "round": committed}, first.text
                    with contextlib.suppress(httpx.TransportError):  # the round closed, the process died
                        upload(http, committed, "b", db)
                if not point:
                    info = http.get(f"/v1/rounds/{committed}", params={"wait": 30}).json()
                    assert info["state"] == "closed", info
            expected = {n: params[n] - (da[n] + db[n]) / 2 for n in params}
            if point:
                runner.wait_dead(point)
                ckpt = CheckpointDir(state / "checkpoints")
                if point == "checkpoint.after_outer_write":  # a half-written checkpoint is left behind ...
                    assert ckpt.outer_path(committed + 1).is_file() and not ckpt.global_path(committed + 1).exists()
                if point == "file.before_rename" and runner_cls is Processes:
                    assert list(ckpt.root.glob("*.tmp*"))
                if point in ("checkpoint.after_global_write", "commit.before_db"):
                    assert ckpt.global_path(committed + 1).is_file()
            if commits:
                committed, theta = committed + 1, expected
            else:
                theta = params
        finally:
            runner.stop()
    assert committed == 2  # commit.after_db and the clean run


def test_crash_at_every_point_then_resume(tmp_path: Path) -> None:
    run_chain(tmp_path, InProcess)


def test_sigkill_at_the_points_that_leave_files_then_resume(tmp_path: Path) -> None:
    run_chain(tmp_path, Processes, points=ON_DISK)


@pytest.mark.slow
def test_sigkill_at_every_point_then_resume(tmp_path: Path) -> None:
    run_chain(tmp_path, Processes)


def test_publish_first_crash_at_every_point_then_resume(tmp_path: Path) -> None:
    """publish_first serves the new model before its checkpoint is written: a crash anywhere in
    the background commit still restarts at the last committed round, never a partial one."""
    run_chain(tmp_path, InProcess, publish_first=True)


# Slow (52 s of CI's 466 s at the 2026-12-02 evening stop): publish_first's crash points stay in the
# default run in process (test_publish_first_crash_at_every_point_then_resume), and real SIGKILLs
# at the on-disk points stay there for the default mode (test_sigkill_at_the_points_...).
@pytest.mark.slow
def test_publish_first_sigkill_at_the_points_that_leave_files_then_resume(tmp_path: Path) -> None:
    run_chain(tmp_path, Processes, publish_first=True, points=ON_DISK)


@pytest.mark.slow
def test_publish_first_sigkill_at_every_point_then_resume(tmp_path: Path) -> None:
    run_chain(tmp_path, Processes, publish_first=True)
