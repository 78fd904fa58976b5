"""GPU check: a DDP and an FSDP participant under torchrun, on NCCL, against a local coordinator.

For each of `--parallel ddp` and `--parallel fsdp` it starts a coordinator on 127.0.0.1 (a small
GPT, a few rounds), runs `torchrun --nproc_per_node N -m fedtrain participant --device D` with a
run directory, and checks:

- the group exits 0;
- the train loss falls (first round's against the last's, from the run directory's metrics.jsonl);
- every rank's final weights equal the coordinator's served model (DDP: each rank's whole copy;
  FSDP: each rank's rows).

It prints one line per check and a summary line, and exits 1 when a check failed.

    python benchmarks/gpu_check.py                      # CUDA, one rank per GPU (NCCL)
    python benchmarks/gpu_check.py --device cpu --ranks 2   # the same on gloo, here

NCCL allows one rank per GPU: on a machine with one GPU run `--ranks 1` (the default with CUDA).
Without CUDA, `--device cuda` prints that it skipped and exits 0. The training process group is
NCCL on CUDA; the participant's control messages travel on a gloo group of its own beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members.auth import Tokens

TOKEN = "gpu-check-token"


def config(rounds: int) -> RunConfig:
    return RunConfig.model_validate({
        "name": "gpu-check", "rounds": rounds, "heartbeat_interval_s": 0.5,
        "train": {"sync_every": 5, "seq_len": 32, "batch_size": 8, "eval_batches": 2, "lr": 3e-3},
        "model": {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32},
    })


def final_rows(run_dir: Path, ranks: int, parallel: str) -> list[tuple[str, dict[str, torch.Tensor], dict]]:
    """(file, tensors, rows) of every rank's final weights: rows {} for a whole copy."""
    files = [run_dir / ("final.safetensors" if k == 0 and parallel == "ddp" else f"final-rank{k}.safetensors")
             for k in range(ranks)]
    out = []
    for f in files:
        with safe_open(str(f), "pt") as st:
            meta = st.metadata() or {}
            rows = json.loads(meta.get("fedtrain.rows", "{}"))
            out.append((f.name, {n: st.get_tensor(n) for n in st.keys()}, rows))  # noqa: SIM118
    return out


def check(parallel: str, device: str, ranks: int, rounds: int, work: Path) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    run_dir = work / f"{parallel}-run"
    with BackgroundCoordinator(work / f"{parallel}-state", config(rounds), tokens=Tokens([TOKEN], "admin")) as c:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        argv = ["-m", "fedtrain", "participant", "--coordinator", c.url, "--data", "stdlib:0/2", "--name",
                f"gpu-{parallel}", "--device", device, "--parallel", parallel, "--run-dir", str(run_dir)]
        t0 = time.perf_counter()
        proc = subprocess.run([*launch, *argv], env={**os.environ, "FEDTRAIN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        served = {n: t.detach().to("cpu").clone() for n, t in c.service.inspect().weights.items()}
        finished = c.service.finished
    results.append((f"{parallel}: torchrun exit 0 and the run finished ({wall:.1f}s)",
                    proc.returncode == 0 and finished, (proc.stdout + proc.stderr)[-2000:]))
    if proc.returncode != 0:
        return results
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    results.append((f"{parallel}: train loss falls ({losses[0]:.3f} -> {losses[-1]:.3f})" if losses else
                    f"{parallel}: train loss falls (no losses recorded)", len(losses) >= 2 and losses[-1] < losses[0],
                    ""))
    worst = 0.0
    for name, tensors, held in final_rows(run_dir, ranks, parallel):
        for n, t in tensors.items():
            want = served[n] if n not in held else served[n][held[n][0]:held[n][1]]
            worst = max(worst, float((t.float() - want.float()).abs().max()) if t.numel() else 0.0)
            if t.shape != want.shape:
                worst = float("inf")
        del name
    results.append((f"{parallel}: every rank's weights equal the served model (max diff {worst:.3g})", worst == 0.0,
                    ""))
    return results


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    cli.add_argument("--ranks", type=int, default=None, help="ranks per participant (default: 1 on cuda, 2 on cpu)")
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--parallel", default="ddp,fsdp", help="which to check, comma separated")
    a = cli.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: skipped (use --device cpu --ranks 2 to run it on gloo)")
        return 0
    ranks = a.ranks or (1 if a.device == "cuda" else 2)
    if a.device == "cuda" and ranks > torch.cuda.device_count():
        print(f"gpu_check: {ranks} ranks need {ranks} GPUs (NCCL: one rank per GPU); this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    print(f"gpu_check: device {a.device}, {ranks} rank(s) per participant, {a.rounds} rounds, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name(0)}" if a.device == "cuda" else ""))
    ok = True
    with tempfile.TemporaryDirectory(prefix="fedtrain-gpu-check-") as tmp:
        for parallel in a.parallel.split(","):
            for what, passed, detail in check(parallel.strip(), a.device, ranks, a.rounds, Path(tmp)):
                print(f"  {'ok  ' if passed else 'FAIL'} {what}")
                if not passed and detail:
                    print("    " + detail.replace("\n", "\n    "))
                ok = ok and passed
    print("gpu_check: all checks passed" if ok else "gpu_check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
