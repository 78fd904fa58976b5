"""Compute utilization with blocking vs overlapped sync, over real `fedtrain demo` runs.

    python benchmarks/overlap.py            # 4 participants, 8 rounds of H=50
    python benchmarks/overlap.py --quick    # 2 participants, 4 rounds of H=50

Each participant reports its wall time in the training loop and the time it spent blocked
in syncs (`sync_s`: upload, round wait, download, the round's evals); utilization is
1 − sync_s / wall_s, the fraction of the participant's wall time spent in training steps.
Evals are off except at the last round, so they do not count against either mode. The
final global held-out loss of both runs is compared as well.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fedtrain.cli.demo import DEMO_CONFIG


def run(mode: str, participants: int, rounds: int, h: int, tmp: Path) -> dict:
    cfg = json.loads(json.dumps(DEMO_CONFIG))
    cfg["rounds"] = rounds
    cfg["train"]["sync_every"] = h
    cfg["train"]["overlap"] = mode == "overlapped"
    cfg["eval"] = {"every": 10_000}
    path = tmp / f"{mode}.json"
    path.write_text(json.dumps(cfg))
    summary = tmp / f"{mode}-summary.json"
    state = tmp / mode
    subprocess.run([sys.executable, "-m", "fedtrain", "demo", "--config", str(path), "--participants",
                    str(participants), "--summary", str(summary), "--state-dir", str(state)],
                   check=True, stdout=subprocess.DEVNULL)
    out = json.loads(summary.read_text())
    utils = []
    for i in range(participants):
        lines = [x for x in (state / "logs" / f"p{i}.log").read_text().splitlines() if x.startswith("{")]
        result = json.loads(lines[-1])
        utils.append(1 - result["sync_s"] / result["wall_s"])
    return {"utilization": sum(utils) / len(utils), "final": out["final_eval_loss"], "wall": out["wall_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sync-every", type=int, default=50)
    args = p.parse_args()
    n, rounds = (2, 4) if args.quick else (4, 8)
    print(f"{n} participants, {rounds} rounds of H={args.sync_every}, demo model, DiLoCo")
    print(f"{'mode':12s} {'utilization':>12s} {'final loss':>11s} {'wall s':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = {m: run(m, n, rounds, args.sync_every, Path(tmp)) for m in ("blocking", "overlapped")}
    for mode, r in rows.items():
        print(f"{mode:12s} {r['utilization']:12.1%} {r['final']:11.3f} {r['wall']:7.0f}")
    b, o = rows["blocking"], rows["overlapped"]
    print(f"overlapped final loss vs blocking: {(o['final'] - b['final']) / b['final']:+.2%}")


if __name__ == "__main__":
    main()
