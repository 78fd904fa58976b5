"""A bounded chaos run: the demo's processes, SIGKILLed at random, and what survived.

A coordinator and N participants run as separate processes on loopback (as in `fedtrain
demo`), training the built-in GPT on shards of Python's standard library. While the run
goes on, a seeded chaos monkey SIGKILLs a random participant or the coordinator every few
seconds and starts it again (same name, same port, same state directory); some coordinator
restarts are armed to kill themselves at a random named fault point of the merge,
checkpoint and commit path (FEDTRAIN_FAULTS). At the end it checks and prints:

- the run finished: every round committed, the global model at the last version;
- the loss fell: held-out loss of the final global model below that of the initial one;
- no committed round was lost: the committed version seen from outside (the admin
  checkpoints list) never went back, and the rounds table holds each round exactly once (a
  served round whose background commit a kill cut short is not lost: it is noted, and merged
  again);
- every checkpoint loads: each kept version's model (against its digest) and outer state;
- no participant exited on its own with an error; the number of kills survived.

However the run stops (every round committed, out of --time-limit, or a process that would
not start), its end is the same: participants finish or are stopped, a coordinator without
faults is brought up if the one running is down or armed, and the final calls (status, held-out
loss) are bounded, their failures reported. The report opens with the outcome: `finished`,
`out of time at round N/M`, or `failed: <reason>`.

    python benchmarks/chaos.py --quick            # ~4-6 minutes on 2 cores
    python benchmarks/chaos.py --quick --mode async   # the same in asynchronous mode
    python benchmarks/chaos.py --seed 7 --json chaos.json

`--mode async` runs the run in asynchronous mode (`schedule.mode: async`): every applied
update is a committed version, so a round of the checks is one applied update, and the run
has --participants times as many of them (the same inner steps in all as --mode rounds).

Exit status 0 for a finished run whose every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from chaos_report import print_report, summarize

from fedtrain.cli.demo import global_eval
from fedtrain.config import RunConfig
from fedtrain.errors import FedtrainError
from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy, Timeouts

FAULT_POINTS = [
    "upload.received",
    "merge.before_step",
    "checkpoint.after_outer_write",
    "file.before_rename",
    "checkpoint.after_global_write",
    "commit.before_db",
    "commit.after_db",
]

# The calls of the run's start and end: each one bounded, so that a coordinator that stays
# away costs a known wait and a line in the report, never a hang or a traceback.
CALL_TIMEOUTS = Timeouts(connect=5.0, read=30.0, write=30.0, pool=10.0)
CALL_RETRY = RetryPolicy(max_elapsed_s=30.0, first_contact_s=30.0)
START_S = 120.0  # the longest a coordinator may take to answer after a (re)start
PARTICIPANTS_END_S = 90.0  # how long participants of a finished run get to exit by themselves
STOP_GRACE_S = 20.0  # SIGTERM, then this long before SIGKILL


class RunFailed(Exception):
    """The run cannot go on: a process that would not start, a first call that got no answer."""


def run_config(args: argparse.Namespace) -> RunConfig:
    if args.quick:
        model = {"n_layer": 1, "n_embd": 64, "n_head": 2, "block_size": 64}
        train = {"sync_every": args.sync_every or 40, "batch_size": 8, "seq_len": 64, "lr": 3e-3, "eval_batches": 2}
    else:
        model = {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 128}
        train = {"sync_every": args.sync_every or 20, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "eval_batches": 4}
    return RunConfig.model_validate(
        {
            "name": "chaos",
            "rounds": args.rounds,
            "model": model,
            "train": train,
            "outer": {"algorithm": "diloco"},
            "schedule": {"mode": args.mode},
            "min_participants": 1,
            "round_timeout_s": 60.0,
            "heartbeat_interval_s": 1.0,
            "heartbeat_timeout_s": 8.0,
            "keep_checkpoints": args.rounds + 1,  # keep every version, so that every one is checked
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Tally:
    kills: dict[str, int] = field(
        default_factory=lambda: {"coordinator": 0, "coordinator_at_point": 0, "participant": 0}
    )
    points_hit: list[str] = field(default_factory=list)
    own_exits: list[str] = field(default_factory=list)  # participants that exited non-zero without being killed
    lost_rounds: list[str] = field(default_factory=list)  # the committed version went back
    dropped: list[str] = field(default_factory=list)  # a served round a kill took back before its commit
    served: int = 0  # the round the coordinator serves (healthz), last seen
    committed: int = 0  # the highest committed version seen (admin checkpoints)


@dataclass
class Final:
    """What the end of the run found: the coordinator's status and the held-out loss, or why not."""

    restart: str = "not needed"  # what was done to have a coordinator without faults for the checks
    status: dict[str, Any] | None = None
    loss: float | None = None
    problems: list[str] = field(default_factory=list)


class Chaos:
    """The processes of the run, their restarts, and the monkey.

    One thread runs all of it. Every restart of the coordinator follows a `wait()` on the one
    before (after its SIGKILL, or once `poll()` saw it exit): the kernel has dropped its lock on
    the state directory by then, so the new one is never refused as a second coordinator. The
    stored config wins on a restart, and `--config` is the same file every time, so a restart
    resumes the run as it was (no `--apply-config`: the run's config never changes).
    """

    def __init__(self, args: argparse.Namespace, cfg: RunConfig) -> None:
        self.args, self.cfg = args, cfg
        self.rng = random.Random(args.seed)
        self.dir = Path(args.dir or tempfile.mkdtemp(prefix="fedtrain-chaos-"))
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.state = self.dir / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token, self.admin_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        self.env = {**os.environ, "FEDTRAIN_TOKEN": self.token, "FEDTRAIN_ADMIN_TOKEN": self.admin_token}
        self.env.pop("FEDTRAIN_FAULTS", None)
        self.procs: dict[str, subprocess.Popen] = {}
        self.armed: str | None = None  # the fault point the running coordinator was started with
        self.tally = Tally()
        self.cfg_path = self.dir / "run.json"
        self.cfg_path.write_text(cfg.model_dump_json(indent=2))

    def spawn(self, name: str, argv: list[str], faults: str = "") -> None:
        env = {**self.env, "FEDTRAIN_FAULTS": faults} if faults else self.env
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "fedtrain", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def start_coordinator(self, fault: str | None = None) -> None:
        """Start the coordinator (armed at `fault`, if given) and wait until it answers; RunFailed if it won't."""
        self.armed = fault
        argv = ["coordinator", "--config", str(self.cfg_path), "--state-dir", str(self.state), "--port", str(self.port)]
        self.spawn("coordinator", argv, f"{fault}:kill" if fault else "")
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            proc = self.procs["coordinator"]
            if proc.poll() is not None:
                if fault:  # killed itself at its point already while resuming: count it and go again clean
                    self._point_hit()
                    return self.start_coordinator(None)
                raise RunFailed(f"the coordinator did not start (exit {proc.returncode}): {self.tail('coordinator')}")
            if self.version() is not None:
                self.observe()
                return
            time.sleep(0.2)
        self.terminate(["coordinator"])
        raise RunFailed(f"the coordinator did not answer within {START_S:.0f} s: {self.tail('coordinator')}")

    def start_participant(self, i: int) -> None:
        n = self.args.participants
        self.spawn(
            f"p{i}",
            [
                "participant",
                "--coordinator",
                self.url,
                "--data",
                f"stdlib:{i}/{n}",
                "--name",
                f"p{i}",
                "--give-up-after",
                "180",
            ],
        )

    def _get(self, path: str, key: str, token: str | None = None) -> int | None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            r = httpx.get(f"{self.url}{path}", headers=headers, timeout=2)
            return int(r.json()[key]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def version(self) -> int | None:
        """The round served (healthz); None while nobody answers."""
        return self._get("/v1/healthz", "current_round")

    def observe(self) -> None:
        """The served round, and the committed version, which must never go back.

        A merged round is served while its checkpoint is written in the background, so a kill
        in between takes the served round back to the last committed one: by design (no
        participant was given that model's last byte, unless publish_first), noted, not lost."""
        t = self.tally
        served = self.version()
        if served is not None:
            if served < t.served:
                t.dropped.append(f"round {served} served after {t.served}")
            t.served = served
        committed = self._get("/v1/admin/checkpoints", "committed_version", self.admin_token)
        if committed is not None:
            if committed < t.committed:
                t.lost_rounds.append(f"committed version {committed} seen after {t.committed}")
            t.committed = max(t.committed, committed)

    def _point_hit(self) -> None:
        self.tally.kills["coordinator_at_point"] += 1
        self.tally.points_hit.append(self.armed or "?")
        self.armed = None

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self.tally.kills["coordinator" if name == "coordinator" else "participant"] += 1

    def restart_dead_coordinator(self) -> bool:
        """Start a coordinator without faults if the last one exited (counting a fault point it hit)."""
        coord = self.procs["coordinator"]
        if coord.poll() is None:
            return False
        if coord.returncode == -signal.SIGKILL and self.armed:
            self._point_hit()
        time.sleep(self.rng.uniform(0.2, 1.0))
        self.start_coordinator(None)
        return True

    def clean_coordinator(self) -> str:
        """For the final checks: a coordinator without faults, restarted if the one running is down or armed."""
        armed = self.armed
        if self.restart_dead_coordinator():
            return "the coordinator was down: restarted without faults"
        if armed is None:
            return "not needed"
        self.terminate(["coordinator"])  # its point could still fire during the checks
        self.start_coordinator(None)
        return f"the coordinator was armed at {armed}: restarted without faults"

    def check_processes(self) -> None:
        """Restart whatever died: the coordinator at a fault point, participants that exited."""
        self.restart_dead_coordinator()
        for i in range(self.args.participants):
            p = self.procs[f"p{i}"]
            if p.poll() is not None:
                if p.returncode != 0:
                    self.tally.own_exits.append(f"p{i} exited with {p.returncode}: {self.tail(f'p{i}')}")
                self.start_participant(i)

    def monkey(self) -> None:
        """One act of chaos: SIGKILL the coordinator (maybe arming a fault point on restart) or a participant."""
        armed = self.armed is not None and self.procs["coordinator"].poll() is None
        if self.rng.random() < self.args.coordinator_share and not armed:  # an armed point is left to fire
            self.kill("coordinator")
            time.sleep(self.rng.uniform(0.2, 2.0))
            fault = self.rng.choice(FAULT_POINTS) if self.rng.random() < self.args.armed_share else None
            self.start_coordinator(fault)
        else:
            i = self.rng.randrange(self.args.participants)
            self.kill(f"p{i}")
            time.sleep(self.rng.uniform(0.2, 2.0))
            self.start_participant(i)

    def participants(self) -> list[str]:
        return [name for name in self.procs if name != "coordinator"]

    def wait_participants(self, timeout_s: float) -> None:
        """Participants of a finished run exit by themselves; a coordinator that dies meanwhile comes back clean."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.procs[n].poll() is None for n in self.participants()):
            self.restart_dead_coordinator()
            time.sleep(0.2)

    def exit_codes(self) -> dict[str, int | None]:
        return {name: self.procs[name].poll() for name in self.participants()}

    def tail(self, name: str, lines: int = 3) -> str:
        try:
            text = (self.dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e.strerror})"
        return " | ".join(text.strip().splitlines()[-lines:])

    def terminate(self, names: list[str]) -> None:
        """SIGTERM the named processes, SIGKILL those still there after STOP_GRACE_S; returns once all are gone."""
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for proc in live:
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stop(self) -> None:
        self.terminate(list(self.procs))


def begin(chaos: Chaos, cfg: RunConfig) -> float:
    """Start the coordinator and the participants; the held-out loss of the initial model."""
    chaos.start_coordinator()
    try:
        with CoordinatorClient(chaos.url, chaos.token, timeouts=CALL_TIMEOUTS, retry=CALL_RETRY) as client:
            initial = global_eval(client, cfg, version=0)
    except FedtrainError as e:
        raise RunFailed(f"held-out loss of the initial model: {e}") from None
    print(
        f"chaos: {chaos.args.participants} participants, {cfg.rounds} rounds of H={cfg.train.sync_every} "
        f"({cfg.schedule.mode} mode), "
        f"seed {chaos.args.seed}, initial held-out loss {initial:.3f}; state in {chaos.dir}",
        flush=True,
    )
    for i in range(chaos.args.participants):
        chaos.start_participant(i)
    return initial


def chaos_loop(chaos: Chaos, cfg: RunConfig, t0: float) -> bool:
    """Watch, restart and kill until every round is committed (True) or the time limit is reached (False)."""
    args, lo, hi = chaos.args, *chaos.args.kill_every
    next_kill = time.monotonic() + chaos.rng.uniform(lo, hi)
    last_print = 0.0
    while time.monotonic() - t0 < args.time_limit:
        chaos.observe()
        if chaos.tally.committed >= cfg.rounds:
            return True
        chaos.check_processes()
        if time.monotonic() >= next_kill and chaos.tally.served < cfg.rounds - args.calm_rounds:
            chaos.monkey()
            next_kill = time.monotonic() + chaos.rng.uniform(lo, hi)
        if time.monotonic() - last_print > 10:
            k = chaos.tally.kills
            print(
                f"[{time.monotonic() - t0:5.0f}s] round {chaos.tally.served}/{cfg.rounds}; kills: "
                f"coordinator {k['coordinator']}, at a fault point {k['coordinator_at_point']}, "
                f"participants {k['participant']}",
                flush=True,
            )
            last_print = time.monotonic()
        time.sleep(0.2)
    return False


def wind_down(chaos: Chaos, cfg: RunConfig, finished: bool) -> Final:
    """The end of every run: participants done (finished) or stopped, a clean coordinator, the final calls."""
    try:
        if finished:
            restart = chaos.clean_coordinator()
            chaos.wait_participants(PARTICIPANTS_END_S)
        else:  # they would train on: stopped first, so that the round reached stays put
            chaos.terminate(chaos.participants())
            restart = chaos.clean_coordinator()
    except RunFailed as e:
        return Final(restart="failed", problems=[f"no coordinator for the final checks: {e}"])
    final = Final(restart=restart)
    with CoordinatorClient(chaos.url, chaos.token, timeouts=CALL_TIMEOUTS, retry=CALL_RETRY) as client:
        try:
            final.status = client.status()
        except FedtrainError as e:
            final.problems.append(f"final status: {e}")
        try:
            final.loss = global_eval(client, cfg)
        except FedtrainError as e:
            final.problems.append(f"held-out loss of the final model: {e}")
    return final


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = run_config(args)
    chaos = Chaos(args, cfg)
    t0 = time.monotonic()
    initial: float | None = None
    failure: str | None = None
    finished = False
    try:
        try:
            initial = begin(chaos, cfg)
            finished = chaos_loop(chaos, cfg, t0)
        except RunFailed as e:
            failure = str(e)
        except KeyboardInterrupt:
            failure = "interrupted"
        wall = time.monotonic() - t0
        final = wind_down(chaos, cfg, finished) if "coordinator" in chaos.procs else Final(problems=["never started"])
        exits = chaos.exit_codes()
    finally:
        chaos.stop()
    return summarize(args, cfg, chaos.state, chaos.dir, chaos.tally, final, initial, failure, finished, wall,
                     time.monotonic() - t0, exits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and a short run (a few minutes)")
    p.add_argument("--participants", type=int, default=3)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default 40 quick, 60 full; in async mode times --participants: versions)")
    p.add_argument("--mode", choices=["rounds", "async"], default="rounds",
                   help="schedule.mode of the run: synchronous rounds, or asynchronous (one version per update)")
    p.add_argument("--sync-every", type=int, default=None, help="H (default 40 quick, 20 full)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN_S", "MAX_S"),
        help="seconds between two kills (default 2 4 quick, 4 8 full)",
    )
    p.add_argument("--coordinator-share", type=float, default=0.4, help="fraction of kills aimed at the coordinator")
    p.add_argument(
        "--armed-share", type=float, default=0.7, help="fraction of coordinator restarts armed with a fault point"
    )
    p.add_argument("--calm-rounds", type=int, default=1, help="no kills in the last rounds (lets the run end)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds of chaos before the run stops and reports how far it got (default 600 quick, 1800 full)",
    )
    p.add_argument("--dir", default=None, help="run directory (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    args = p.parse_args()
    args.rounds = args.rounds or (40 if args.quick else 60) * (args.participants if args.mode == "async" else 1)
    args.kill_every = args.kill_every or ([2.0, 4.0] if args.quick else [4.0, 8.0])
    args.time_limit = args.time_limit or (600.0 if args.quick else 1800.0)
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
