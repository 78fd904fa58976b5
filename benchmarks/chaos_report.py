"""What survived a chaos run (`chaos.py`): the rounds table, the kept checkpoints, the report.

Run after every process of the run is gone: reads the state directory the run left
(its database and checkpoint files) and prints the outcome, the kills survived and each
check, pass or fail.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import FedtrainError


def committed_rounds(state: Path) -> tuple[list[int], list[str]]:
    """The rounds table, read after every process is gone; returns (rounds, problems)."""
    if not (state / "run.db").exists():
        return [], ["no run database"]
    try:
        store = Store(state / "run.db")
    except (FedtrainError, sqlite3.Error) as e:
        return [], [f"run database: {e}"]
    try:
        return sorted(r["round"] for r in store.rounds(limit=100000)), []
    except (FedtrainError, sqlite3.Error) as e:
        return [], [f"run database: {e}"]
    finally:
        store.close()


def check_checkpoints(state: Path) -> tuple[int, list[str]]:
    """Load every kept version (model against its digest, outer state); returns (count, problems)."""
    if not (state / "run.db").exists():
        return 0, ["no run database"]
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


def outcome_of(failure: str | None, finished: bool, reached: int, rounds: int) -> str:
    if failure is not None:
        return f"failed: {failure}"
    return "finished" if finished else f"out of time at round {reached}/{rounds}"


def summarize(args: Any, cfg: Any, state: Path, run_dir: Path, tally: Any, final: Any, initial: float | None,
              failure: str | None, finished: bool, wall: float, total_s: float,
              exits: dict[str, Any]) -> dict[str, Any]:
    """The run's report: what the state directory holds, each check, pass or fail."""
    committed, db_problems = committed_rounds(state)
    loaded, ckpt_problems = check_checkpoints(state)
    t = tally
    status = final.status or {}
    reached = int(status.get("current_round", t.committed))
    # A round may still close (on a heartbeat timeout) between the final status and the stop:
    # the table must hold rounds 0.. once each, at least up to the one reached.
    contiguous = committed == list(range(len(committed))) and len(committed) >= reached
    checks = {
        "run finished": bool(status.get("finished")) and reached == cfg.rounds,
        "loss fell": initial is not None and final.loss is not None and final.loss < initial,
        "no committed round lost": not t.lost_rounds and not db_problems and contiguous,
        "every checkpoint loads": not ckpt_problems and loaded == len(committed) + 1,
        # a finished run's participants exit 0 by themselves; one stopped at the end says nothing
        "no participant exited on an error": not t.own_exits and (not finished or all(c == 0 for c in exits.values())),
    }
    outcome = outcome_of(failure, finished, reached, cfg.rounds)
    return {
        "outcome": outcome,
        "seed": args.seed,
        "participants": args.participants,
        "rounds": cfg.rounds,
        "rounds_done": reached,
        "sync_every": cfg.train.sync_every,
        "mode": cfg.schedule.mode,
        "time_limit_s": args.time_limit,
        "wall_s": round(wall, 1),
        "total_s": round(total_s, 1),
        "initial_loss": None if initial is None else round(initial, 4),
        "final_loss": None if final.loss is None else round(final.loss, 4),
        "kills": dict(t.kills),
        "kills_survived": sum(t.kills.values()),
        "fault_points_hit": t.points_hit,
        "served_rounds_dropped": t.dropped,
        "checkpoints_loaded": loaded,
        "final_restart": final.restart,
        "problems": {
            "final_checks": final.problems,
            "lost_rounds": t.lost_rounds + db_problems,
            "checkpoints": ckpt_problems,
            "participant_exits": t.own_exits,
            "final_exit_codes": exits,
        },
        "checks": checks,
        "passed": outcome == "finished" and all(checks.values()),
        "state_dir": str(run_dir),
    }


def loss_text(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.3f}"


def print_report(r: dict[str, Any]) -> None:
    k = r["kills"]
    why = {"finished": "every round committed"}.get(r["outcome"], "")
    if r["outcome"].startswith("out of time"):
        why = f"time limit of {r['time_limit_s']:.0f} s reached"
    print(f"\nchaos run: {r['outcome']}" + (f" ({why})" if why else ""))
    print(
        f"{r['participants']} participants, {r['rounds_done']}/{r['rounds']} rounds of H={r['sync_every']} "
        f"({r.get('mode', 'rounds')} mode), "
        f"seed {r['seed']}, {r['wall_s']:.0f}s of chaos, {r['total_s']:.0f}s in all"
    )
    print(
        f"kills survived: {r['kills_survived']} (coordinator SIGKILL {k['coordinator']}, coordinator at a fault "
        f"point {k['coordinator_at_point']} {r['fault_points_hit']}, participants {k['participant']})"
    )
    print(f"served rounds a kill took back before their commit: {len(r['served_rounds_dropped'])}")
    print(f"held-out loss of the global model: {loss_text(r['initial_loss'])} -> {loss_text(r['final_loss'])}")
    print(f"checkpoints loaded: {r['checkpoints_loaded']}; before the final checks: {r['final_restart']}")
    for name, ok in r["checks"].items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    if not r["passed"]:
        print(json.dumps(r["problems"], indent=2))
    print(f"state and logs: {r['state_dir']}")
    print("PASSED" if r["passed"] else "NOT PASSED", flush=True)
