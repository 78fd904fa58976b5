"""`fedtrain demo`: a coordinator and N participants on this machine, over loopback HTTP.

Every piece runs as its own process, exactly as on separate machines (`fedtrain
coordinator`, `fedtrain participant`); this module only starts them, shows progress from
the coordinator's status, evaluates the global model at the start and the end on held-out
text, and prints (and optionally writes as JSON) a summary. Ctrl+C stops every process.

More: docs/architecture.md, "cli/demo.py".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedtrain.cli.report import eval_rows, format_evals, human_bytes, table
from fedtrain.config import RunConfig, load_config, parse_config
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.errors import FedtrainError
from fedtrain.merge.outer_lr import recommended_outer_lr
from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy

DEMO_CONFIG: dict[str, Any] = {
    "name": "demo",
    "rounds": 10,
    # warmup_steps: from scratch at lr 3e-3, AdamW's first ~20 steps spike the loss now and then
    # (one step to ~6.4 on held-out data, recovered the step after); a short sync period shows
    # the spike in the eval before the sync. 20 steps of warmup took them all away (docs/quality.md).
    "train": {"sync_every": 40, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup_steps": 20, "eval_batches": 8},
    "model": {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 128},
    "eval": {"every": 1, "global_data": "stdlib:heldout", "global_batches": 16},
    "heartbeat_interval_s": 2.0,
    "heartbeat_timeout_s": 60.0,
}

RECOMMENDED_COMPRESSION = "int2"
"""The demo's compression, both ways (without --config or --compression): docs/quality.md's
recommended preset (issue #32), dense 2-bit values with DiLoCo's outer Nesterov step ..."""

RECOMMENDED_TRAIN = {"compression_block": 64, "compression_scale": "bf16", "entropy_coding": "deflate"}
"""... a bf16 scale per 64 values, codes and scales deflated (the rest of the preset's `train`)."""

HETEROGENEOUS = (1.0, 0.5, 0.25)
"""The speeds of `--heterogeneous`, participant by participant (cycled)."""


def default_participants(args: argparse.Namespace) -> int:
    """--participants, else 3 with --heterogeneous (one per speed), else 4."""
    if args.participants is not None:
        return int(args.participants)
    return len(HETEROGENEOUS) if getattr(args, "heterogeneous", False) else 4


def speeds(args: argparse.Namespace, n: int) -> list[float]:
    """Each participant's speed: all 1 unless --heterogeneous."""
    return [HETEROGENEOUS[i % 3] if getattr(args, "heterogeneous", False) else 1.0 for i in range(n)]


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's run config. Without --config, `min_participants` is the demo's participant
    count: every round waits for all of them (a participant slow to start, on a loaded machine,
    would otherwise miss the first rounds, which close when everyone who has joined submitted).
    DiLoCo's outer lr, unless the config gives one, is the recommended table's for the demo's
    participants and H (`recommended_outer_lr`); the compression, both ways, the recommended
    preset's (`RECOMMENDED_COMPRESSION` with `RECOMMENDED_TRAIN`) unless --compression (the scheme
    alone, with the config's block, fp32 scales and plain codes) or --config says."""
    cfg = load_config(args.config) if args.config else RunConfig.model_validate(DEMO_CONFIG)
    data = cfg.model_dump()
    if not args.config:
        data["min_participants"] = max(default_participants(args), 1)
    data["outer"]["algorithm"] = args.algorithm
    picked = getattr(args, "compression", None)
    compression = picked or (None if args.config else RECOMMENDED_COMPRESSION)
    if compression is not None and not picked:
        data["train"].update(RECOMMENDED_TRAIN)
    if compression is not None:
        data["train"]["compression"] = compression
        data["train"]["download_compression"] = "none" if compression == "bf16" else compression
    if args.rounds is not None:
        data["rounds"] = args.rounds
    if args.sync_every is not None:
        data["train"]["sync_every"] = args.sync_every
    if args.algorithm == "diloco" and data["outer"]["lr"] is None:
        data["outer"]["lr"] = recommended_outer_lr(max(default_participants(args), 1), data["train"]["sync_every"])
    k = getattr(args, "streaming", None)
    if k is not None:
        data["streaming"] = {"fragments": k, "overlap": 1, "alpha": 0.5}
        if args.rounds is None:
            data["rounds"] *= k  # as many inner steps as without it: a round syncs one fragment
    schedule = getattr(args, "schedule", None)
    if schedule is not None or (getattr(args, "heterogeneous", False) and k is None):
        data["schedule"]["mode"] = schedule or "balanced"
    return parse_config(data, source="the demo's run config")


def global_eval(client: CoordinatorClient, cfg: RunConfig, version: int | None = None) -> float:
    """Held-out loss of the global model on stdlib modules no participant trains on
    (`eval.global_batches` batches of `train.batch_size`, the coordinator's own global eval)."""
    from fedtrain.recipes import build_model, load_data, loss_fn, tokenizer_of
    from fedtrain.recipes.data import TokenStream, evaluate, heldout_paths

    model = build_model(cfg.model, seed=cfg.seed)
    _, tensors = client.download(version=version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(tensors[name])
    tokens = load_data(cfg.model, heldout_paths(), tokenizer_of(cfg.model))
    batch = cfg.train.batch_size
    stream = TokenStream(tokens, batch_size=batch, seq_len=cfg.train.seq_len, seed=0, heldout_fraction=0.5)
    return evaluate(model, stream.eval_batches(cfg.eval.global_batches), loss_fn(cfg.model))


def wait_for_global_eval(client: CoordinatorClient, cfg: RunConfig, version: int, wait_s: float = 30.0) -> list:
    """The run's metrics, once the coordinator's eval of the final version is in (bounded wait)."""
    deadline = time.monotonic() + wait_s
    while True:
        metrics = client.metrics()
        done = any(m["name"] == "global_eval/loss" and m["round"] == version for m in metrics)
        if done or cfg.eval.global_data is None or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


class Demo:
    """The processes of one demo run and their clean-up."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.n = default_participants(args)
        if self.n < 1:
            raise FedtrainError("--participants must be at least 1")
        self.speeds = speeds(args, self.n)
        self.speed_of = {f"p{i}": speed for i, speed in enumerate(self.speeds)}
        self.cfg = demo_config(args)
        # A directory of the user's own is theirs to keep; a temp dir is removed after a run that
        # finished, unless --keep (a failed or interrupted run keeps it: its logs say why).
        self.temporary = args.state_dir is None and not getattr(args, "keep", False)
        self.dir = args.state_dir or Path(tempfile.mkdtemp(prefix="fedtrain-demo-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.token = Tokens.generate()
        self.env = {
            **os.environ,
            "FEDTRAIN_TOKEN": self.token,
            "FEDTRAIN_ADMIN_TOKEN": Tokens.generate(),
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = ""

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.dir / "logs" / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedtrain", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def start_coordinator(self) -> None:
        cfg_path = self.dir / "run.json"
        cfg_path.write_text(self.cfg.model_dump_json(indent=2))
        endpoint = self.dir / "state" / "endpoint.json"
        endpoint.unlink(missing_ok=True)
        proc = self._spawn(
            "coordinator",
            [
                "coordinator",
                "--config",
                str(cfg_path),
                "--state-dir",
                str(self.dir / "state"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ],
        )
        deadline = time.monotonic() + 300  # a pretrained recipe loads its model before it listens
        while not endpoint.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise FedtrainError(
                    f"the coordinator did not start; see {self.dir / 'logs' / 'coordinator.log'}:\n"
                    + self.tail("coordinator")
                )
            time.sleep(0.1)
        self.url = json.loads(endpoint.read_text())["url"]

    def start_participants(self) -> None:
        for i in range(self.n):
            run_dir = self.dir / "participants" / f"p{i}"
            argv = ["participant", "--coordinator", self.url, "--data", f"stdlib:{i}/{self.n}", "--name", f"p{i}"]
            slow = ["--speed", f"{self.speeds[i]:g}"] if self.speeds[i] < 1 else []
            self._spawn(f"p{i}", [*argv, "--run-dir", str(run_dir), *slow])

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.dir / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def remove_temporary(self) -> bool:
        """Delete the demo's temp dir (state, logs, checkpoints); True if it was removed."""
        if not self.temporary:
            return False
        shutil.rmtree(self.dir, ignore_errors=True)
        return True

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _phase(t0: float, text: str) -> None:
    """One line saying what the demo does now, stamped like the progress lines: its first seconds
    (processes starting, torch loading, the first H steps) are otherwise silent."""
    print(f"[{time.monotonic() - t0:5.0f}s] {text}", flush=True)


def _progress_line(status: dict[str, Any], t0: float) -> str:
    parts = [f"[{time.monotonic() - t0:5.0f}s] round {status['current_round']}/{status['rounds']}"]
    if not status["participants"]:
        parts.append("waiting for the participants to join")
    k = (status.get("streaming") or {}).get("k") or 1  # Streaming DiLoCo: a round is H/K of a fragment's H
    for p in status["participants"]:
        loss = "-" if p["loss"] is None else f"{p['loss']:.3f}"
        rate = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"
        told = "" if p.get("sync_every") is None else f" H={p['sync_every']}" if k == 1 else \
            f" H/K={p['sync_every'] // k}"
        parts.append(f"{p['id']} loss {loss} {rate} tok/s{told}")
    return " | ".join(parts)


def monitor(demo: Demo, client: CoordinatorClient, t0: float) -> dict[str, Any]:
    """Print progress until the run finishes; fail clearly if the participants die."""
    last_round, last_print = -1, 0.0
    while True:
        status = client.status()
        now = time.monotonic()
        if status["current_round"] != last_round or now - last_print > 10:
            print(_progress_line(status, t0), flush=True)
            last_round, last_print = status["current_round"], now
        if status["finished"]:
            return status
        dead = [n for n, p in demo.procs.items() if p.poll() not in (None, 0)]
        if dead:  # the rounds wait for every participant: one that failed would hold the run forever
            name = "coordinator" if "coordinator" in dead else dead[0]
            raise FedtrainError(
                f"{name} exited with status {demo.procs[name].returncode}; last lines of its log:\n{demo.tail(name)}"
            )
        time.sleep(1.0)


def summarize(
    demo: Demo,
    status: dict[str, Any],
    initial: float,
    final: float,
    wall: float,
    metrics: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    cfg, n = demo.cfg, demo.n
    total_tokens = sum(p["tokens"] for p in status["participants"]) or 1
    # the inner steps of one lockstep worker that train the same tokens (rounds x H in lockstep)
    steps = total_tokens / (cfg.train.batch_size * cfg.train.seq_len * n)
    model_bytes = status["model_bytes"]
    # Synchronous data parallelism all-reduces the gradient every step: a ring all-reduce sends
    # 2(N-1)/N model-sized buffers per worker per step.
    dp_bytes = int(steps * n * 2 * (n - 1) / n * model_bytes) if n > 1 else 0
    up = sum(p["bytes_up"] for p in status["participants"])
    down = sum(p["bytes_down"] for p in status["participants"])
    return {
        "run": cfg.name,
        "algorithm": cfg.outer.algorithm,
        "participants": n,
        "rounds": cfg.rounds,
        "sync_every": cfg.train.sync_every,
        "schedule": cfg.schedule.mode,
        "streaming": cfg.streaming.model_dump() if cfg.streaming is not None else None,
        "parameters": status["parameters"],
        "model_bytes": model_bytes,
        "wall_s": round(wall, 1),
        "initial_eval_loss": round(initial, 4),
        "final_eval_loss": round(final, 4),
        "per_participant": [
            {
                "id": p["id"],
                "tokens": p["tokens"],
                "weight": round(p["tokens"] / total_tokens, 4),
                "bytes_up": p["bytes_up"],
                "bytes_down": p["bytes_down"],
                "speed": demo.speed_of.get(p["id"], 1.0),
                "steps_by_round": steps_by_round(metrics or [], p["id"], cfg),
            }
            for p in status["participants"]
        ],
        "bytes_up": up,
        "bytes_down": down,
        "dp_equivalent_bytes": dp_bytes,
        "bytes_per_round": _bytes_per_round(status),
        "evals": eval_rows(metrics or []),
        "state_dir": str(demo.dir / "state"),
    }


def steps_by_round(metrics: list[dict[str, Any]], pid: str, cfg: RunConfig) -> list[int]:
    """The inner steps `pid` ran in each round, from the tokens it reported (balanced rounds: its own H)."""
    per_step = cfg.train.batch_size * cfg.train.seq_len
    rows = sorted((m["round"], m["value"]) for m in metrics
                  if m.get("participant_id") == pid and m["name"] == "tokens" and m.get("round") is not None)
    return [round(value / per_step) for _, value in rows]


def _bytes_per_round(status: dict[str, Any]) -> dict[str, Any]:
    """What one participant sends and receives per round (the sync set, plus headers)."""
    rounds = [r for r in status.get("recent_rounds", []) if r["n_submissions"]]
    up = [r["bytes_in"] / r["n_submissions"] for r in rounds]
    return {
        "sync_set_bytes": status["model_bytes"],
        "upload_per_participant": round(sum(up) / len(up)) if up else 0,
    }


def print_summary(s: dict[str, Any]) -> None:
    st = s.get("streaming")
    rounds = f"H={s['sync_every']}" if st is None else \
        f"H/K={s['sync_every'] // st['fragments']} (Streaming DiLoCo, K={st['fragments']} fragments)"
    print(
        f"\nfedtrain demo: {s['algorithm']}, {s['participants']} participants, {s['rounds']} rounds of "
        f"{rounds}, {s['parameters']:,} parameters, {s['wall_s']:.0f}s"
    )
    print(f"global eval loss (held-out): {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f}\n")
    if s.get("evals"):
        print("evals around each sync (held-out loss: each participant on its own data's held-out slice, "
              "the global model on the shared held-out set):")
        print(format_evals(s["evals"]) + ("\n" if st is None else ""))
        if st is not None:
            print(f"(Streaming DiLoCo: a round syncs one of the {st['fragments']} fragments, so the global model "
                  "holds fragments last synced in different rounds, and its loss need not fall every round; "
                  "a participant's eval after a sync mixes in the global fragment with alpha "
                  f"{st.get('alpha', 0.5)}.)\n")
    print(
        table(
            ["participant", "speed", "H by round", "tokens", "weight", "uploaded", "downloaded"],
            [
                [
                    p["id"],
                    f"{p.get('speed', 1.0):g}x",
                    " ".join(str(h) for h in p.get("steps_by_round", [])) or "-",
                    f"{p['tokens']:,}",
                    f"{p['weight']:.3f}",
                    human_bytes(p["bytes_up"]),
                    human_bytes(p["bytes_down"]),
                ]
                for p in s["per_participant"]
            ],
        )
    )
    sent = s["bytes_up"] + s["bytes_down"]
    if s["participants"] > 1:  # one participant has nothing to all-reduce with
        ratio = f" ({s['dp_equivalent_bytes'] / sent:.0f}x more)" if sent else ""
        print(
            f"\nsent through the coordinator: {human_bytes(sent)}; synchronous data-parallel training "
            f"would have sent {human_bytes(s['dp_equivalent_bytes'])}{ratio} for the same steps"
        )
    else:
        print(f"\nsent through the coordinator: {human_bytes(sent)}")
    per_round = s["bytes_per_round"]
    print(
        f"per round and participant: {human_bytes(per_round['upload_per_participant'])} up "
        f"(sync set {human_bytes(per_round['sync_set_bytes'])})"
    )
    if s.get("state_removed"):
        print("state and logs: removed (a temp dir; run with --keep, or --state-dir DIR, to keep them)")
    else:
        print(f"state and logs: {s['state_dir']}")


def run_demo(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    demo = Demo(args)
    t0 = time.monotonic()
    try:
        _phase(t0, "starting the coordinator (a process of its own, as on a server)...")
        demo.start_coordinator()
        where = f"{demo.dir}, removed at the end unless --keep" if demo.temporary else str(demo.dir)
        print(f"coordinator: {demo.url}  (state and logs in {where})", flush=True)
        with CoordinatorClient(demo.url, demo.token, retry=RetryPolicy(max_elapsed_s=30)) as client:
            _phase(t0, f"evaluating the initial global model on held-out text ({demo.cfg.eval.global_batches} "
                   "batches)...")
            initial = global_eval(client, demo.cfg, version=0)
            if any(speed < 1 for speed in demo.speeds):
                sites = ", ".join(f"p{i} {speed:g}x" for i, speed in enumerate(demo.speeds))
                print(f"heterogeneous sites: {sites} speed; schedule.mode {demo.cfg.schedule.mode}", flush=True)
            st = demo.cfg.streaming
            if st is not None:
                print(f"Streaming DiLoCo: {st.fragments} fragments, one synced every "
                      f"{demo.cfg.train.sync_every // st.fragments} inner steps (overlap {st.overlap}, alpha "
                      f"{st.alpha:g})", flush=True)
            if demo.cfg.outer.algorithm == "diloco":
                print(f"outer lr {demo.cfg.outer.lr:g} (Nesterov, momentum 0.9), recommended for M={demo.n}, "
                      f"H={demo.cfg.train.sync_every} (docs/quality.md; --config sets your own)", flush=True)
            print(f"initial global eval loss: {initial:.3f}", flush=True)
            _phase(t0, f"starting {demo.n} participants (a process each: it loads torch and its data, joins, and "
                   f"trains {demo.cfg.train.sync_every} inner steps before its first sync; a line per round "
                   "follows, and one every 10 s)...")
            demo.start_participants()
            status = monitor(demo, client, t0)
            for name, proc in demo.procs.items():
                if name != "coordinator":
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=60)
            final = global_eval(client, demo.cfg)
            status = client.status()
            metrics = wait_for_global_eval(client, demo.cfg, status["current_round"])
    except KeyboardInterrupt:
        print(f"\nstopping the demo; its state and logs stay in {demo.dir}", file=sys.stderr, flush=True)
        raise
    except FedtrainError as e:
        raise FedtrainError(f"{e.message}\n(state and logs kept in {demo.dir})") from None
    finally:
        demo.stop()
    summary = summarize(demo, status, initial, final, time.monotonic() - t0, metrics)
    summary["state_removed"] = demo.remove_temporary()
    print_summary(summary)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.summary}")
    return 0
