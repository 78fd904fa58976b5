"""FSDP participants (issue #20): each rank's memory during a sync, and seconds per sync.

    python benchmarks/fsdp_sync.py                   # 10M, 50M, 100M parameters (~5 minutes here)
    python benchmarks/fsdp_sync.py --quick           # 10M only, one run of all three (~1 minute)
    python benchmarks/fsdp_sync.py --sizes 20e6      # any sizes

The model is a stack of `--layers` (8) square Linear layers, float32, trained with AdamW on
random inputs for `--steps` (H = 2) inner steps per round. For each size two runs go through a
real coordinator (its own process) on loopback, every rank a process of its own (gloo, CPU,
`torch.distributed.run`, one thread each):

- side by side: a 2-rank FSDP `Participant` (FSDP2 `fully_shard` per layer then the root, the
  model built on the meta device and materialised shard by shard, so no rank ever held it
  whole) and a single-process `Participant` with the same model, in the same rounds;
- DDP: a 2-rank DDP `Participant` (`DistributedDataParallel`; rank 0 speaks HTTP and holds
  the snapshot, every rank the whole model), alone.

Memory, measured by each rank on itself from /proc/self/status: `baseline` is the RSS after
torch and the process group are up, before the model; before each sync step the rank reads
its RSS (`before`) and resets its peak (writing 5 to /proc/self/clear_refs), and after it reads
VmHWM (`peak`): the highest RSS during the sync (Δ, the upload, the wait, the download, the
copy into the model). `growth` = peak − before: what the sync itself added. `peak − baseline`
holds everything the rank keeps for the model: its parameters (its shard under FSDP), AdamW's
two moments, the snapshot (one more copy of what it syncs: its shard, or on DDP's rank 0 the
whole model), DDP's gradient buckets, and the sync's own temporaries. Each figure is the
largest over the measured syncs; `shard` is the bytes the rank syncs (its rows under FSDP,
the whole model under DDP and for the single process).

Sync seconds: each participant's own (from the start of its H-th step to the new weights in
its model: upload, wait for the round to close, download); the seconds its client spent in
`upload` (for FSDP, whose ranks upload in parallel, that of the piece the coordinator answered
as completing the update, and that of the other) and in `download` (per rank); and from the
round's last upload, of any rank, to the new weights in its model. Side by side, a round closes
once both have uploaded, so the first to upload waits for the other. Medians over `--rounds`
rounds after `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sync_throughput's coordinator helpers, when run as a script or a worker

from sync_throughput import TOKEN, start_coordinator  # noqa: E402

from fedtrain.participant import CoordinatorClient  # noqa: E402
from fedtrain.wire import write_file  # noqa: E402

MB = 1e6
BATCH = 4  # rows of the random input per inner step


# -- the model and the measurements, on every rank ---------------------------------------------


def build(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def init_weights(width: int, layers: int) -> dict[str, torch.Tensor]:
    """The run's initial global weights (small random values; any would do)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        out[f"{i}.weight"] = torch.randn(width, width, generator=g) * 0.02
        out[f"{i}.bias"] = torch.zeros(width)
    return out


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS (Linux >= 4.0)


class TimedClient(CoordinatorClient):
    """The participant's own client, noting when each upload and download call starts and ends
    (wall clock: the processes of a run compare them)."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        # (start, end, whether the answer says this piece completed the update: None for a whole one)
        self.calls: dict[str, list[tuple[float, float, bool | None]]] = {"upload": [], "download": []}

    def upload(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        answer = super().upload(*args, **kwargs)
        complete = answer.get("complete") if isinstance(answer, dict) and "piece" in answer else None
        self.calls["upload"].append((t0, time.time(), complete))
        return answer

    def download(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        got = super().download(*args, **kwargs)
        self.calls["download"].append((t0, time.time(), None))
        return got


def train(fed: Any, model: nn.Module, opt: torch.optim.Optimizer, width: int) -> list[dict[str, float]]:
    """The user's loop, with the memory probe around every step of `fed` (see the module)."""
    gen = torch.Generator().manual_seed(1 + (torch.distributed.get_rank() if torch.distributed.is_initialized()
                                             else 0))
    syncs = []
    while not fed.finished:
        loss = model(torch.randn(BATCH, width, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = status_mb("VmRSS")
        reset_peak()
        start = time.time()
        if fed.step(tokens=BATCH, loss=float(loss)):
            syncs.append({"before": before, "peak": status_mb("VmHWM"), "start": start, "end": time.time()})
    return syncs


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from fedtrain.participant import Participant
    from fedtrain.transport.allocator import tune_allocator

    if args.allocator == "tuned" and not tune_allocator():
        raise RuntimeError("glibc did not take the allocator tuning: run with --allocator glibc")
    torch.set_num_threads(1)
    distributed = args.worker in ("fsdp", "ddp")
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    client = TimedClient(args.url, TOKEN)
    client.health()  # the HTTP stack loaded too
    baseline = status_mb("VmRSS")  # everything imported, the process group up: no model yet
    if args.worker == "fsdp":
        with torch.device("meta"):
            model = build(args.width, args.layers)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")  # this rank's shards only; the global rows come at join
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fed: Any = Participant(client, model=model, name="fsdp", keepalive_s=1.0)
    elif args.worker == "ddp":
        plain = build(args.width, args.layers)
        model = DistributedDataParallel(plain)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fed = Participant(client, model=plain, inner_optimizer=opt, name="ddp", keepalive_s=1.0)
    else:
        model = build(args.width, args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fed = Participant(client, model=model, inner_optimizer=opt, name="single")
    with fed:
        syncs = train(fed, model, opt, args.width)
    model_bytes = sum(p.numel() * p.element_size() for p in build_meta(args.width, args.layers).parameters())
    report = {"role": args.worker, "rank": rank, "baseline": baseline, "syncs": syncs,
              "shard_bytes": fed.shard_bytes or model_bytes, "model_bytes": model_bytes,  # DDP rank 1: no snapshot
              "calls": client.calls}
    Path(args.out, f"{args.worker}-rank{rank}.json").write_text(json.dumps(report))
    if distributed:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()


def build_meta(width: int, layers: int) -> nn.Module:
    with torch.device("meta"):
        return build(width, layers)


# -- the driver ----------------------------------------------------------------------------------


def launch(role: str, url: str, out: Path, width: int, args: argparse.Namespace) -> subprocess.Popen:
    argv = [str(Path(__file__).resolve()), "--worker", role, "--url", url, "--out", str(out),
            "--width", str(width), "--layers", str(args.layers), "--allocator", args.allocator]
    prefix = [sys.executable]
    if role != "single":
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "FEDTRAIN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*prefix, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(run_dir: Path, init: Path, roles: list[str], width: int, args: argparse.Namespace) -> list[dict]:
    """One run of `roles` against one coordinator; every rank's report."""
    run_dir.mkdir()
    extra = {"rounds": args.warmup + args.rounds, "train": {"sync_every": args.steps}}
    proc, url = start_coordinator(run_dir, init, len(roles), extra)
    groups: list[subprocess.Popen] = []
    try:
        groups = [launch(role, url, run_dir, width, args) for role in roles]
        for role, g in zip(roles, groups, strict=True):
            out, _ = g.communicate(timeout=args.timeout)
            if g.returncode != 0:
                raise RuntimeError(f"{role} failed ({g.returncode}):\n{out[-4000:]}")
    finally:
        for g in groups:  # a group still running when another failed, or past its time
            if g.poll() is None:
                g.kill()
                g.communicate()
        proc.terminate()
        proc.wait(timeout=30)
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("*-rank*.json"))]


def memory_row(params: float, rep: dict, warmup: int) -> str:
    syncs = rep["syncs"][warmup:] or rep["syncs"]
    peak = max(s["peak"] for s in syncs)
    growth = max(s["peak"] - s["before"] for s in syncs)
    before = max(s["before"] for s in syncs)
    shard, model = rep["shard_bytes"] / MB, rep["model_bytes"] / MB
    return (f"| {params / 1e6:.0f}M | {rep['role']} | {rep['rank']} | {shard:.0f} | {rep['baseline']:.0f} | "
            f"{before:.0f} | {peak:.0f} | {growth:.0f} | {growth / shard:.2f} | {(peak - rep['baseline']) / shard:.2f} "
            f"| {growth / model:.2f} |")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def time_row(params: float, reps: list[dict], warmup: int) -> str:
    """Per participant: its sync's seconds, its upload calls (FSDP: of the piece that completed
    the update, and of the other), from the round's last upload (of any rank of any participant)
    to the new weights in its model, its ranks' download calls."""
    rounds = range(warmup, len(reps[0]["syncs"]))
    last_upload = {r: max(rep["calls"]["upload"][r][1] for rep in reps if rep["calls"]["upload"]) for r in rounds}
    cells = []
    for role in ("fsdp", "single"):
        ranks = sorted((rep for rep in reps if rep["role"] == role), key=lambda rep: rep["rank"])
        lead = ranks[0]["syncs"]
        sync = median([lead[r]["end"] - lead[r]["start"] for r in rounds])
        after = median([lead[r]["end"] - last_upload[r] for r in rounds])
        calls = [rep["calls"]["upload"][r] for r in rounds for rep in ranks]
        if role == "fsdp":  # the completing piece's upload, then the other's
            up = "/".join(f"{median([b - a for a, b, done in calls if done == want]):.2f}" for want in (True, False))
        else:
            up = f"{median([b - a for a, b, _ in calls]):.2f}"
        # the first download is the join's
        down = "/".join(f"{median([b - a for a, b, _ in rep['calls']['download'][1 + warmup:]]):.2f}" for rep in ranks)
        cells.append(f"{sync:.2f} | {up} | {after:.2f} | {down}")
    return f"| {params / 1e6:.0f}M | " + " | ".join(cells) + " |"


def driver(args: argparse.Namespace) -> None:
    sizes = args.sizes or ([10e6] if args.quick else [10e6, 50e6, 100e6])
    print(f"model: {args.layers} square Linear layers, float32; AdamW; H = {args.steps}; {args.warmup} warm-up "
          f"round(s), then {args.rounds} measured; 2 ranks per group (gloo, CPU, 1 thread each); allocator "
          f"{args.allocator}")
    memory, times = [], []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for params in sizes:
            width = round(math.sqrt(params / args.layers))
            weights = init_weights(width, args.layers)
            init = tmp / f"init-{width}.safetensors"
            write_file(init, weights)
            if args.quick:  # one run of all three: one coordinator start, the two launches overlapped
                reps = run(tmp / f"all-{width}", init, ["fsdp", "single", "ddp"], width, args)
                side = [r for r in reps if r["role"] != "ddp"]
                ddp = [r for r in reps if r["role"] == "ddp"]
            else:
                side = run(tmp / f"side-{width}", init, ["fsdp", "single"], width, args)
                ddp = run(tmp / f"ddp-{width}", init, ["ddp"], width, args)
            params_n = sum(t.numel() for t in weights.values())
            memory += [memory_row(params_n, r, args.warmup) for r in side + ddp]
            times.append(time_row(params_n, side, args.warmup))
            print(f"  {params_n / 1e6:.0f}M done", flush=True)
    print("\nMemory per rank during a sync (MB = 10^6 bytes; see the module docstring for each column)")
    print("| params | participant | rank | shard MB | baseline MB | before sync MB | peak in sync MB | growth MB "
          "| growth ÷ shard | (peak − baseline) ÷ shard | growth ÷ model |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(memory))
    print("\nSeconds per sync, side by side in the same rounds (median; upload and download per rank)")
    print("| params | FSDP sync s | FSDP upload s (completing/other piece) | FSDP last upload → weights s "
          "| FSDP download s (rank 0/1) | single sync s | single upload s | single last upload → weights s "
          "| single download s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="10M parameters only, 1 + 2 rounds, the DDP group in the same run as the other two")
    p.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="model sizes in parameters (default 10e6,50e6,100e6)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="H: inner steps per round")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not measured")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it is stopped")
    p.add_argument("--allocator", choices=["tuned", "glibc"], default="tuned",
                   help="tuned (default): every participant process gives freed blocks of 1 MiB or more back "
                        "to the OS, as the coordinator does (fedtrain.transport.allocator), so RSS follows the "
                        "live tensors; glibc: as it is, keeping freed memory for reuse")
    p.add_argument("--worker", choices=["fsdp", "ddp", "single"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    args.rounds = args.rounds or (2 if args.quick else 3)
    torch.set_num_threads(1)
    driver(args)


if __name__ == "__main__":
    main()
