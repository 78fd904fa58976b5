"""Sites of different speed (issue #22): lockstep rounds, balanced rounds and asynchronous mode
side by side, with three participants at 1x, 0.5x and 0.25x speed, and a homogeneous lockstep run
(three at 1x) as the reference.

Each run is a coordinator and three `fedtrain participant` processes on loopback (127.0.0.1, a
free port), training the built-in GPT on the three stdlib shards (`stdlib:i/3`); a slow site is
`--speed`'s throttle (participant/engine/pace.py: after each step it sleeps (1/speed - 1) x that step's
own time). Every run gets the same token budget: R lockstep rounds of H steps by three
participants (3·R·H steps of batch_size x seq_len tokens). A run ends at the first committed
version whose tokens, summed over the committed versions, reach the budget (lockstep: version R;
asynchronous: 3·R updates of H steps; balanced rounds: its rounds hold about 3.5·H steps each, so
fewer of them, and the last may pass the budget by part of a round: the table says by how much).

Measured, per run:

- **to target**: seconds from the moment all three participants had joined to the commit of the first version
  whose held-out loss is at or below the target. The target is the reference run's held-out loss
  at 80% of its budget (linear in tokens between the two versions around that point). Every
  version is kept and evaluated after the run, the same way for every run, on the held-out stdlib
  modules (`stdlib:heldout`: `recipes.data.evaluate` over fixed windows, as `fedtrain demo`'s
  global eval), so the evaluation costs the run no time.
- **to budget** and **final loss**: the same for the version at the budget.
- **utilization** per participant: time in its training loop ÷ time in the run, from its join to
  the budget's commit. Time not training is the time its syncs blocked it (each sync reports its
  own seconds, `sync_s`, when it ends; a sync still open at the budget's commit counts up to then).
- **bytes**: sent through the coordinator, uploads plus downloads of all participants, counted
  at the first status after the budget's commit.

    python benchmarks/heterogeneous.py --quick     # ~3 minutes on 2 cores
    python benchmarks/heterogeneous.py             # larger batches and budget (~8 minutes on 2 cores)
    python benchmarks/heterogeneous.py --quick --json hetero.json --only reference rounds
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy
from fedtrain.recipes import build_model
from fedtrain.recipes.build import load_data, loss_fn, tokenizer_of
from fedtrain.recipes.data import TokenStream, evaluate, heldout_paths

SPEEDS = (1.0, 0.5, 0.25)
TARGET_AT = 0.8  # the target: the reference's held-out loss at this fraction of its budget
POLL_S = 0.25
GRACE_S = 3.0  # after the budget's commit: for the last syncs' reports to arrive
START_S = 120.0
STOP_S = 15.0


@dataclass(frozen=True)
class Setup:
    n_layer: int
    n_embd: int
    n_head: int
    batch_size: int
    seq_len: int
    sync_every: int  # H
    rounds: int  # R: the budget is R lockstep rounds of H steps by three participants
    eval_batches: int = 16

    def model(self) -> dict[str, Any]:
        return {"n_layer": self.n_layer, "n_embd": self.n_embd, "n_head": self.n_head, "block_size": self.seq_len}

    @property
    def budget(self) -> int:
        return 3 * self.rounds * self.sync_every * self.batch_size * self.seq_len


QUICK = Setup(n_layer=2, n_embd=128, n_head=4, batch_size=8, seq_len=64, sync_every=30, rounds=8)
FULL = Setup(n_layer=2, n_embd=128, n_head=4, batch_size=16, seq_len=64, sync_every=40, rounds=12)


@dataclass(frozen=True)
class Mode:
    name: str
    schedule: str
    speeds: tuple[float, ...]


MODES = (
    Mode("reference", "rounds", (1.0, 1.0, 1.0)),
    Mode("rounds", "rounds", SPEEDS),
    Mode("balanced", "balanced", SPEEDS),
    Mode("async", "async", SPEEDS),
)


def run_config(setup: Setup, mode: Mode) -> RunConfig:
    # Lockstep runs end at R by themselves; the others get room and are stopped at the budget.
    rounds = setup.rounds if mode.schedule == "rounds" else 4 * setup.rounds
    return RunConfig.model_validate({
        "name": f"hetero-{mode.name}",
        "rounds": rounds,
        "model": setup.model(),
        "train": {"sync_every": setup.sync_every, "batch_size": setup.batch_size, "seq_len": setup.seq_len,
                  "lr": 3e-3, "eval_batches": 2},
        "outer": {"algorithm": "diloco"},
        "schedule": {"mode": mode.schedule},
        # Local evals only at round 0 and the last; no coordinator eval: the benchmark evaluates after.
        "eval": {"every": 1_000_000, "global_data": None},
        # A round waits for all three (a fast site would otherwise close round 0 alone before the
        # others joined); asynchronous mode applies one update at a time.
        "min_participants": 1 if mode.schedule == "async" else len(mode.speeds),
        "round_timeout_s": 600.0,
        "heartbeat_interval_s": 1.0,
        "heartbeat_timeout_s": 120.0,
        "keep_checkpoints": rounds + 1,  # every version stays, to be evaluated after the run
    })


class Processes:
    """What one run started, and stopping all of it (process groups of our own children only)."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "FEDTRAIN_TOKEN": secrets.token_urlsafe(24),
                    "FEDTRAIN_ADMIN_TOKEN": secrets.token_urlsafe(24), "PYTHONUNBUFFERED": "1"}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "fedtrain", *argv], stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def tail(self, name: str, lines: int = 12) -> str:
        path = self.dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def stop(self, names: list[str] | None = None) -> None:
        chosen = [p for n, p in self.procs.items() if names is None or n in names]
        for proc in chosen:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for proc in chosen:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def start_coordinator(procs: Processes, cfg: RunConfig) -> str:
    cfg_path = procs.dir / "run.json"
    cfg_path.write_text(cfg.model_dump_json(indent=2))
    endpoint = procs.dir / "state" / "endpoint.json"
    proc = procs.spawn("coordinator", ["coordinator", "--config", str(cfg_path), "--state-dir",
                                       str(procs.dir / "state"), "--host", "127.0.0.1", "--port", "0"])
    deadline = time.monotonic() + START_S
    while not endpoint.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the coordinator did not start:\n" + procs.tail("coordinator"))
        time.sleep(0.1)
    return str(json.loads(endpoint.read_text())["url"])


class HeldOut:
    """The held-out loss of a global version, the same way for every run (as `fedtrain demo`'s)."""

    def __init__(self, cfg: RunConfig, batches: int) -> None:
        self.model = build_model(cfg.model, seed=cfg.seed)
        tokens = load_data(cfg.model, heldout_paths(), tokenizer_of(cfg.model))
        stream = TokenStream(tokens, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0,
                             heldout_fraction=0.5)
        self.batches = list(stream.eval_batches(batches))
        self.loss = loss_fn(cfg.model)

    def __call__(self, client: CoordinatorClient, version: int) -> float:
        _, tensors = client.download(version=version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])
        return evaluate(self.model, self.batches, self.loss)


def watch(procs: Processes, client: CoordinatorClient, budget: int, t0: float, log: Any) -> dict[str, Any]:
    """Poll the status until the committed versions hold the budget; what was seen on the way."""
    rounds: dict[int, dict[str, Any]] = {}
    joined: dict[str, float] = {}
    last_print = 0.0
    while True:
        status = client.status()
        now = time.time()
        for r in status["recent_rounds"]:
            rounds.setdefault(r["round"], {"closed_at": r["closed_at"], "tokens": r["tokens"]})
        for p in status["participants"]:
            joined.setdefault(p["id"], now)
        total, done = 0, None
        for r in sorted(rounds):
            total += rounds[r]["tokens"]
            if total >= budget:
                done = r
                break
        if done is not None:
            return {"rounds": rounds, "joined": joined, "status": status, "budget_round": done}
        if now - last_print > 10:
            log(f"version {status['current_round']}, {total:,} of {budget:,} tokens")
            last_print = now
        dead = [n for n, p in procs.procs.items() if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"{dead[0]} exited ({procs.procs[dead[0]].returncode}):\n{procs.tail(dead[0])}")
        if now - t0 > 3600:
            raise RuntimeError("the run did not reach its budget within an hour")
        time.sleep(POLL_S)


def blocked_s(syncs: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside the syncs (each (ended_at, seconds))."""
    return sum(max(0.0, min(ts, end) - max(ts - s, start)) for ts, s in syncs)


def utilization(metrics: list[dict[str, Any]], joined: dict[str, float], end: float) -> dict[str, float]:
    """Each participant's time training ÷ its time in the run, from its join to `end`."""
    out = {}
    for pid, start in joined.items():
        syncs = [(m["ts"], m["value"]) for m in metrics if m["name"] == "sync_s" and m["participant_id"] == pid]
        out[pid] = max(0.0, 1 - blocked_s(syncs, start, end) / max(1e-9, end - start))
    return out


def run_mode(setup: Setup, mode: Mode, workdir: Path) -> dict[str, Any]:
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{mode.name} {time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    cfg = run_config(setup, mode)
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes(workdir)
    try:
        url = start_coordinator(procs, cfg)
        with CoordinatorClient(url, procs.env["FEDTRAIN_ADMIN_TOKEN"], retry=RetryPolicy(max_elapsed_s=30)) as client:
            held = HeldOut(cfg, setup.eval_batches)
            t0 = time.time()
            for i, speed in enumerate(mode.speeds):
                procs.spawn(f"p{i}", ["participant", "--coordinator", url, "--data", f"stdlib:{i}/3",
                                      "--name", f"p{i}", "--speed", f"{speed:g}"])
            seen = watch(procs, client, setup.budget, t0, log)
            end_round = seen["budget_round"]
            t_end = seen["rounds"][end_round]["closed_at"]
            time.sleep(GRACE_S)  # the last syncs report their seconds
            metrics = client.metrics(name="sync_s")
            procs.stop([n for n in procs.procs if n != "coordinator"])
            log(f"budget reached at version {end_round + 1}, {t_end - t0:.1f}s after launch; evaluating the versions")
            # Times count from the moment all three had joined (each process's start-up, ~5 s on a
            # loaded machine, is the same in every mode and not the schedule's doing).
            t_all = max(seen["joined"].values())
            curve = []  # (version, tokens so far, committed at (s after all joined), held-out loss)
            tokens = 0
            curve.append((0, 0, 0.0, held(client, 0)))
            for r in sorted(k for k in seen["rounds"] if k <= end_round):
                tokens += seen["rounds"][r]["tokens"]
                curve.append((r + 1, tokens, seen["rounds"][r]["closed_at"] - t_all, held(client, r + 1)))
    finally:
        procs.stop()
    status = seen["status"]
    util = utilization(metrics, seen["joined"], t_end)
    names = {p["id"]: p.get("name") or p["id"] for p in status["participants"]}
    return {
        "mode": mode.name, "schedule": mode.schedule, "speeds": list(mode.speeds), "curve": curve,
        "to_budget_s": t_end - t_all, "final_loss": curve[-1][3], "tokens": curve[-1][1], "budget": setup.budget,
        "versions": end_round + 1, "joined_by_s": max(seen["joined"].values()) - t0,
        "joined_s": {names.get(pid, pid): at - t0 for pid, at in sorted(seen["joined"].items())},
        "bytes": sum(p["bytes_up"] + p["bytes_down"] for p in status["participants"]),
        "utilization": {names.get(pid, pid): u for pid, u in sorted(util.items())},
        "share": {names.get(p["id"], p["id"]): p["tokens"] for p in status["participants"]},
    }


def loss_at_tokens(curve: list[tuple], tokens: float) -> float:
    """The held-out loss at `tokens`, linear between the versions around it."""
    for (_, t0, _, l0), (_, t1, _, l1) in itertools.pairwise(curve):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(1, t1 - t0)
    return curve[-1][3]


def time_to(curve: list[tuple], target: float) -> float | None:
    return next((c[2] for c in curve if c[3] <= target), None)


def at_budget(r: dict[str, Any]) -> float:
    """The held-out loss at exactly the budget's tokens: the final version's, or (balanced rounds,
    whose last round passes the budget) linear between the two versions around the budget."""
    return loss_at_tokens(r["curve"], r["budget"])


def joins(r: dict[str, Any]) -> str:
    if "joined_s" not in r:  # a --json file written before the joins were recorded one by one
        return f"all by {r['joined_by_s']:.1f}"
    return " / ".join(f"{t:.1f}" for t in r["joined_s"].values())


def report(setup: Setup, results: list[dict[str, Any]]) -> str:
    ref = next((r for r in results if r["mode"] == "reference"), results[0])
    target = loss_at_tokens(ref["curve"], TARGET_AT * ref["budget"])
    sync = next((r for r in results if r["mode"] == "rounds"), None)
    sync_t = time_to(sync["curve"], target) if sync else None
    lines = [
        f"budget {setup.budget:,} tokens (R={setup.rounds} lockstep rounds of H={setup.sync_every}, 3 participants, "
        f"batch {setup.batch_size} x {setup.seq_len}); target held-out loss {target:.4f} "
        f"(the reference's at {TARGET_AT:.0%} of its budget)",
        "",
        "| run | speeds | to target (s) | vs rounds | to budget (s) | versions | tokens | final loss | "
        "at budget | vs reference | utilization p0 / p1 / p2 | bytes sent |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = time_to(r["curve"], target)
        ratio = f"{t / sync_t:.2f}x" if t is not None and sync_t else "-"
        util = " / ".join(f"{u:.0%}" for u in r["utilization"].values())
        lines.append(
            f"| {r['mode']} ({r['schedule']}) | {'/'.join(f'{s:g}' for s in r['speeds'])} | "
            f"{'not reached' if t is None else f'{t:.1f}'} | {ratio} | {r['to_budget_s']:.1f} | {r['versions']} | "
            f"{r['tokens'] / r['budget']:.2f}x | {r['final_loss']:.4f} | {at_budget(r):.4f} | "
            f"{(at_budget(r) / at_budget(ref) - 1) * 100:+.2f}% | {util} | {r['bytes'] / 1e6:.1f} MB |")
    lines.append("")
    lines.append("tokens each participant contributed (share of the run's committed tokens):")
    for r in results:
        total = sum(r["share"].values()) or 1
        lines.append(f"  {r['mode']}: " + ", ".join(f"{k} {v / total:.0%}" for k, v in r["share"].items())
                     + f"; joined {joins(r)} s after launch")
    return "\n".join(lines)


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller budget (a few minutes)")
    ap.add_argument("--only", nargs="+", choices=[m.name for m in MODES], help="run only these")
    ap.add_argument("--json", type=Path, help="write every run's figures and curve here")
    ap.add_argument("--keep", type=Path, help="keep the runs' state and logs in this directory")
    ap.add_argument("--report", type=Path, metavar="JSON", help="print the table of a --json file, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        print(report(Setup(**saved["setup"]), saved["results"]))
        return 0
    setup = QUICK if args.quick else FULL
    todo = [m for m in MODES if not args.only or m.name in args.only]
    # Ctrl+C and SIGTERM end the same way: every process of the run in flight is stopped.
    # (SIGINT too when started in the background, where the shell hands it down ignored.)
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="fedtrain-hetero-") as tmp:
            base = args.keep or Path(tmp)
            results = [run_mode(setup, m, base / m.name) for m in todo]
    except KeyboardInterrupt as e:
        print(f"interrupted ({str(e) or 'Ctrl+C'}): every process of the run was stopped", file=sys.stderr)
        return 130
    text = report(setup, results)
    print("\n" + text)
    print(f"\n{len(results)} runs in {time.perf_counter() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps({"setup": setup.__dict__, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
