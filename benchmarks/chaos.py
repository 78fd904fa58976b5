"""A bounded chaos run: the demo's processes, SIGKILLed at random, and what survived.

A coordinator and N participants run as separate processes on loopback (as in `fedtrain
demo`), training the built-in GPT on shards of Python's standard library. While the run
goes on, a seeded chaos monkey SIGKILLs a random participant or the coordinator every few
seconds and starts it again (same name, same port, same state directory); some coordinator
restarts are armed to kill themselves at a random named fault point of the merge,
checkpoint and commit path (FEDTRAIN_FAULTS). At the end it checks and prints:

- the run finished: every round committed, the global model at the last version;
- the loss fell: held-out loss of the final global model below that of the initial one;
- no committed round was lost: the committed version seen from outside never went back,
  and the rounds table holds each round exactly once;
- every checkpoint loads: each kept version's model (against its digest) and outer state;
- no participant exited on its own with an error; the number of kills survived.

    python benchmarks/chaos.py --quick            # ~2-4 minutes on 2 cores
    python benchmarks/chaos.py --seed 7 --json chaos.json

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
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

from fedtrain.config import RunConfig
from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.store import Store
from fedtrain.demo import global_eval
from fedtrain.participant.client import CoordinatorClient, RetryPolicy

FAULT_POINTS = [
    "upload.received",
    "merge.before_step",
    "checkpoint.after_outer_write",
    "file.before_rename",
    "checkpoint.after_global_write",
    "commit.before_db",
    "commit.after_db",
]


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
    lost_rounds: list[str] = field(default_factory=list)
    max_seen: int = 0


class Chaos:
    """The processes of the run, their restarts, and the monkey."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig) -> None:
        self.args, self.cfg = args, cfg
        self.rng = random.Random(args.seed)
        self.dir = Path(args.dir or tempfile.mkdtemp(prefix="fedtrain-chaos-"))
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.state = self.dir / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(16)
        self.env = {**os.environ, "FEDTRAIN_TOKEN": self.token, "FEDTRAIN_ADMIN_TOKEN": secrets.token_urlsafe(16)}
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
        self.armed = fault
        argv = ["coordinator", "--config", str(self.cfg_path), "--state-dir", str(self.state), "--port", str(self.port)]
        self.spawn("coordinator", argv, f"{fault}:kill" if fault else "")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            proc = self.procs["coordinator"]
            if proc.poll() is not None:
                if fault:  # killed itself at its point already while resuming: count it and go again clean
                    self._point_hit()
                    return self.start_coordinator(None)
                raise SystemExit(f"the coordinator did not start; see {self.dir / 'logs' / 'coordinator.log'}")
            version = self.version()
            if version is not None:
                if version < self.tally.max_seen:
                    self.tally.lost_rounds.append(f"restart at round {version} after {self.tally.max_seen} was seen")
                return
            time.sleep(0.2)
        raise SystemExit("the coordinator did not answer within 120 s")

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

    def version(self) -> int | None:
        try:
            r = httpx.get(f"{self.url}/v1/healthz", timeout=2)
            return int(r.json()["current_round"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def observe(self) -> None:
        v = self.version()
        if v is not None:
            if v < self.tally.max_seen:
                self.tally.lost_rounds.append(f"round {v} seen after {self.tally.max_seen}")
            self.tally.max_seen = max(self.tally.max_seen, v)

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

    def check_processes(self, finished: bool) -> None:
        """Restart whatever died: the coordinator at a fault point, participants that exited."""
        coord = self.procs["coordinator"]
        if coord.poll() is not None:
            if coord.returncode == -signal.SIGKILL and self.armed:
                self._point_hit()
            time.sleep(self.rng.uniform(0.2, 1.0))
            self.start_coordinator(None)
        for i in range(self.args.participants):
            p = self.procs[f"p{i}"]
            if p.poll() is not None and not finished:
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

    def tail(self, name: str, lines: int = 3) -> str:
        text = (self.dir / "logs" / f"{name}.log").read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def check_checkpoints(state: Path) -> tuple[int, list[str]]:
    """Load every kept version (model against its digest, outer state); returns (count, problems)."""
    store = Store(state / "run.db")
    problems, loaded = [], 0
    try:
        ckpt = CheckpointDir(state / "checkpoints")
        for v in ckpt.versions():
            try:
                ckpt.load_global(v, store.get_meta(f"digest/{v}"))
                ckpt.load_outer(v)
                loaded += 1
            except Exception as e:
                problems.append(f"version {v}: {e}")
        if list(ckpt.root.glob("*.tmp*")):
            problems.append("temporary files left behind")
    finally:
        store.close()
    return loaded, problems


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = run_config(args)
    chaos = Chaos(args, cfg)
    t0 = time.monotonic()
    lo, hi = args.kill_every
    try:
        chaos.start_coordinator()
        with CoordinatorClient(chaos.url, chaos.token, retry=RetryPolicy(max_elapsed_s=60)) as client:
            initial = global_eval(client, cfg, version=0)
        print(
            f"chaos: {args.participants} participants, {cfg.rounds} rounds of H={cfg.train.sync_every}, "
            f"seed {args.seed}, initial held-out loss {initial:.3f}; state in {chaos.dir}",
            flush=True,
        )
        for i in range(args.participants):
            chaos.start_participant(i)
        next_kill = time.monotonic() + chaos.rng.uniform(lo, hi)
        last_print = 0.0
        finished = False
        while time.monotonic() - t0 < args.time_limit:
            chaos.observe()
            finished = chaos.tally.max_seen >= cfg.rounds
            if finished:
                break
            chaos.check_processes(finished)
            if time.monotonic() >= next_kill and chaos.tally.max_seen < cfg.rounds - args.calm_rounds:
                chaos.monkey()
                next_kill = time.monotonic() + chaos.rng.uniform(lo, hi)
            if time.monotonic() - last_print > 10:
                k = chaos.tally.kills
                print(
                    f"[{time.monotonic() - t0:5.0f}s] round {chaos.tally.max_seen}/{cfg.rounds}; kills: "
                    f"coordinator {k['coordinator']}, at a fault point {k['coordinator_at_point']}, "
                    f"participants {k['participant']}",
                    flush=True,
                )
                last_print = time.monotonic()
            time.sleep(0.2)
        wall = time.monotonic() - t0
        for i in range(args.participants):  # they finish by themselves once the run has
            with contextlib.suppress(subprocess.TimeoutExpired):
                chaos.procs[f"p{i}"].wait(timeout=60)
        exits = {f"p{i}": chaos.procs[f"p{i}"].returncode for i in range(args.participants)}
        with CoordinatorClient(chaos.url, chaos.token, retry=RetryPolicy(max_elapsed_s=60)) as client:
            status = client.status()
            final = global_eval(client, cfg)
    finally:
        chaos.stop()
    committed = sorted(r["round"] for r in Store(chaos.state / "run.db").rounds(limit=100000))
    loaded, ckpt_problems = check_checkpoints(chaos.state)
    t = chaos.tally
    checks = {
        "run finished": bool(status["finished"]) and status["current_round"] == cfg.rounds,
        "loss fell": final < initial,
        "no committed round lost": not t.lost_rounds and committed == list(range(cfg.rounds)),
        "every checkpoint loads": not ckpt_problems and loaded == cfg.rounds + 1,
        "no participant exited on an error": not t.own_exits and all(c == 0 for c in exits.values()),
    }
    return {
        "seed": args.seed,
        "participants": args.participants,
        "rounds": cfg.rounds,
        "sync_every": cfg.train.sync_every,
        "wall_s": round(wall, 1),
        "initial_loss": round(initial, 4),
        "final_loss": round(final, 4),
        "kills": dict(t.kills),
        "kills_survived": sum(t.kills.values()),
        "fault_points_hit": t.points_hit,
        "checkpoints_loaded": loaded,
        "problems": {
            "lost_rounds": t.lost_rounds,
            "checkpoints": ckpt_problems,
            "participant_exits": t.own_exits,
            "final_exit_codes": exits,
        },
        "checks": checks,
        "passed": all(checks.values()),
        "state_dir": str(chaos.dir),
    }


def print_report(r: dict[str, Any]) -> None:
    k = r["kills"]
    print(
        f"\nchaos run: {r['participants']} participants, {r['rounds']} rounds of H={r['sync_every']}, "
        f"seed {r['seed']}, {r['wall_s']:.0f}s"
    )
    print(
        f"kills survived: {r['kills_survived']} (coordinator SIGKILL {k['coordinator']}, coordinator at a fault "
        f"point {k['coordinator_at_point']} {r['fault_points_hit']}, participants {k['participant']})"
    )
    print(f"held-out loss of the global model: {r['initial_loss']:.3f} -> {r['final_loss']:.3f}")
    print(f"checkpoints loaded: {r['checkpoints_loaded']}")
    for name, ok in r["checks"].items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    if not r["passed"]:
        print(json.dumps(r["problems"], indent=2))
    print(f"state and logs: {r['state_dir']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and a short run (a few minutes)")
    p.add_argument("--participants", type=int, default=3)
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 40 quick, 60 full)")
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
    p.add_argument("--time-limit", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--dir", default=None, help="run directory (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    args = p.parse_args()
    args.rounds = args.rounds or (40 if args.quick else 60)
    args.kill_every = args.kill_every or ([2.0, 4.0] if args.quick else [4.0, 8.0])
    args.time_limit = args.time_limit or (600.0 if args.quick else 1800.0)
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
