"""Side by side with torchft: time one DiLoCo outer step adds, on the same model, in one run.

    python benchmarks/torchft_compare.py --setup      # once: torchft 0.2.0 in .benchmarks/torchft-venv
    python benchmarks/torchft_compare.py --quick      # 25M fp32 parameters, a few minutes
    python benchmarks/torchft_compare.py              # 100M fp32 parameters (400 MB)

Three systems move the same model (P fp32 parameters in 8 tensors) between 2 replicas on
loopback, one after the other, each started fresh:

* plain gloo all-reduce (torch.distributed, 2 processes): the floor for moving the bytes;
* torchft 0.2.0 `DiLoCo` (its own venv, `torchft_lighthouse` with min_replicas=2, one
  replica group of world size 1 per process, `ProcessGroupGloo`, `Manager(init_sync=False,
  use_async_quorum=False)`, outer SGD(lr=0.7, momentum=0.9, nesterov=True)). The inner step
  is cheap (a constant .grad and an SGD step), so one outer step = the wall time of the
  optimizer step that triggers the sync minus the median plain inner step; a step ends when
  both replicas are done (max over the two);
* fedtrain DiLoCo through the real HTTP coordinator (`sync_throughput.run_rounds`): both
  participants upload Δ concurrently, the coordinator merges and runs the outer Nesterov
  step, both download θ. Participants are client threads of one process there, so only
  the coordinator's memory is a separate figure.

The first outer steps of each system (`--warmup`, default 3) are a warm-up and are
dropped: connections, torchft's process-group configuration, and fedtrain's first
checkpoints, which go to fresh files until the coordinator has spares to write over, and
are slower for it. Five outer steps are measured (`--outer-steps`) and their median
reported, so that one slow step on a shared machine barely moves it. Times here drift, so
read the ratios.
torchft runs from its own venv because it pins a different dependency set; the workers
are this same file started with `--worker`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
VENV = BENCH_DIR.parent / ".benchmarks" / "torchft-venv"
TORCHFT_VERSION = "0.2.0"
RESULT = "RESULT "


# ---------------------------------------------------------------- shared helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def replica_tensors(params: int, tensors: int) -> list[torch.Tensor]:
    """Identical on every replica (same seed): torchft's init_sync=False assumes exactly that."""
    g = torch.Generator().manual_seed(0)
    per = params // tensors
    return [torch.randn(per, generator=g) * 0.02 for _ in range(tensors)]


def emit(result: dict[str, Any]) -> None:
    print(RESULT + json.dumps(result), flush=True)


def share_of_cores(replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // replicas)


# ---------------------------------------------------------------- workers (run as subprocesses)


def gloo_worker(args: argparse.Namespace) -> None:
    """Plain torch.distributed gloo all-reduce of the model's tensors, no torchft."""
    import torch.distributed as dist

    torch.set_num_threads(share_of_cores(2))
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{args.port}", rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=args.op_timeout))
    try:
        ts = replica_tensors(args.params, args.tensors)
        times = []
        for _ in range(args.warmup + args.outer_steps):
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(t, async_op=True) for t in ts]
            for w in works:
                w.wait()
            times.append(time.perf_counter() - t0)
        emit({"sync": times[args.warmup:], "vmhwm": vm_hwm()})
    finally:
        dist.destroy_process_group()


def torchft_worker(args: argparse.Namespace) -> None:
    """One torchft replica group (world size 1) training with DiLoCo; times each optimizer step."""
    from torch import nn
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(share_of_cores(2))
    baseline = vm_hwm()
    model = nn.ParameterList([nn.Parameter(t) for t in replica_tensors(args.params, args.tensors)])
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    # Each replica group hosts its own store (Manager connects to it as a client).
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    op = timedelta(seconds=args.op_timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=op), load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        min_replica_size=2, use_async_quorum=False, init_sync=False, replica_id=f"replica_{args.rank}",
        lighthouse_addr=args.lighthouse, store_addr=HOST, store_port=store.port, rank=0, world_size=1,
        hostname=HOST, timeout=op, quorum_timeout=op, connect_timeout=timedelta(seconds=60), max_retries=0)
    inner_s: list[float] = []
    sync_step_s: list[float] = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
            for step in range(1, (args.warmup + args.outer_steps) * args.sync_every + 1):
                for p in model:  # fresh each step, as backward would: DiLoCo replaces .grad at a sync
                    p.grad = torch.full_like(p, 1e-4)
                t0 = time.perf_counter()
                inner.step()  # DiLoCo's post-hook runs the outer step every sync_every steps
                dt = time.perf_counter() - t0
                (sync_step_s if step % args.sync_every == 0 else inner_s).append(dt)
        if manager.errored():
            raise RuntimeError(f"torchft manager errored: {manager.errored()}")
        emit({"sync_step": sync_step_s[args.warmup:], "inner": inner_s, "vmhwm": vm_hwm(), "baseline": baseline,
              "commits": manager.batches_committed()})
    finally:
        manager.shutdown(wait=False)


def fedtrain_worker(args: argparse.Namespace) -> None:
    """The real coordinator in its own process, 2 participants as client threads (sync_throughput)."""
    sys.path.insert(0, str(BENCH_DIR))
    import sync_throughput as st  # noqa: I001  (benchmarks/ is not a package)
    from fedtrain.wire import EncodedBody, write_file

    torch.set_num_threads(1)  # as sync_throughput: the client threads only move bytes
    model = st.make_model(args.params, args.tensors)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        init = tmp / "init.safetensors"
        write_file(init, model)
        proc, url = st.start_coordinator(tmp, init, 2, {"publish_first": bool(args.publish_first)})
        try:
            times = st.run_rounds(url, 2, model, args.warmup + args.outer_steps)[args.warmup:]
            rss = st.peak_rss(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    # What run_rounds leaves out on a participant, done as `Participant` does it: Δ = θ_round −
    # θ_local written over its snapshot of θ_round, the body's digest, and copying the
    # downloaded θ (into that snapshot) into the model. Timed on one thread; the first of
    # three times is dropped, as its buffers are touched for the first time.
    local = {k: v + 1e-4 for k, v in model.items()}
    snapshot = {k: v.clone() for k, v in model.items()}
    prep = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k in model:
            snapshot[k].sub_(local[k])
        EncodedBody(snapshot).digest()
        for k in model:
            local[k].copy_(snapshot[k])
        prep.append(time.perf_counter() - t0)
    emit({"sync": times, "coordinator_vmhwm": rss, "participant_prep": prep[1:]})


# ---------------------------------------------------------------- orchestration


def venv_python() -> Path:
    return VENV / "bin" / "python"


def setup_venv() -> None:
    """torchft 0.2.0 with this machine's CPU torch (pip resolves torch==X to the local wheel)."""
    base_torch = torch.__version__.split("+")[0]
    cmds = [[sys.executable, "-m", "venv", str(VENV)],
            [str(venv_python()), "-m", "pip", "install", "--quiet", f"torch=={base_torch}",
             f"torchft=={TORCHFT_VERSION}", "numpy"]]
    for cmd in cmds:
        print("setup:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=1800)
    check_venv()


def check_venv() -> str:
    if not venv_python().exists():
        sys.exit(f"torchft venv missing at {VENV}; create it with: python benchmarks/{Path(__file__).name} --setup")
    probe = subprocess.run([str(venv_python()), "-c", "import torch, torchft.manager, torchft.local_sgd; "
                            "from importlib.metadata import version; print(version('torchft'), torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        sys.exit(f"torchft does not import in {VENV} (rerun --setup):\n{probe.stderr[-2000:]}")
    return probe.stdout.strip().splitlines()[-1]


def kill_group(proc: subprocess.Popen) -> None:
    """Each child leads its own session, so this also ends what it started (the coordinator)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_workers(label: str, cmds: list[list[str]], timeout: float, tmp: Path,
                env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start the commands together; every one must print a RESULT line within `timeout` seconds."""
    procs, logs = [], []
    try:
        for i, cmd in enumerate(cmds):
            out, err = tmp / f"{label}{i}.out", tmp / f"{label}{i}.err"
            logs.append((out, err))
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{label}: no result within {timeout:.0f} s; {tail(logs)}") from None
        results = []
        for (out, _), p in zip(logs, procs, strict=True):
            lines = [x for x in out.read_text().splitlines() if x.startswith(RESULT)]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{label}: a worker exited with {p.returncode}; {tail(logs)}")
            results.append(json.loads(lines[-1][len(RESULT):]))
        return results
    finally:
        for p in procs:
            kill_group(p)


def tail(logs: list[tuple[Path, Path]]) -> str:
    parts = []
    for out, err in logs:
        text = (out.read_text() + err.read_text()).strip()
        parts.append(f"--- {err.name}:\n" + "\n".join(text.splitlines()[-25:]))
    return "worker output:\n" + "\n".join(parts)


def worker_cmd(python: str | Path, kind: str, args: argparse.Namespace, **extra: Any) -> list[str]:
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", kind, "--params", str(args.params),
           "--tensors", str(args.tensors), "--outer-steps", str(args.outer_steps), "--warmup", str(args.warmup),
           "--sync-every", str(args.sync_every), "--op-timeout", str(args.op_timeout), "--timeout", str(args.timeout)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def measure_gloo(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port()
    res = run_workers("gloo", [worker_cmd(sys.executable, "gloo", args, rank=r, port=port) for r in range(2)],
                      args.timeout, tmp)
    return {"sync": [max(a, b) for a, b in zip(res[0]["sync"], res[1]["sync"], strict=True)]}


def measure_torchft(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port()
    lh_log = (tmp / "lighthouse.err").open("w")
    lighthouse = subprocess.Popen(
        [str(VENV / "bin" / "torchft_lighthouse"), "--bind", f"{HOST}:{port}", "--min_replicas", "2",
         "--join_timeout_ms", "1000"], stdout=lh_log, stderr=lh_log, start_new_session=True)
    try:
        sys.path.insert(0, str(BENCH_DIR))  # not at the top: torchft's workers run without fedtrain
        from sync_throughput import wait_port

        wait_port(port, lighthouse, "torchft_lighthouse", 60)
        addr = f"http://{HOST}:{port}"
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": addr, "PYTHONWARNINGS": "ignore"}
        res = run_workers("torchft", [worker_cmd(venv_python(), "torchft", args, rank=r, lighthouse=addr)
                                      for r in range(2)], args.timeout, tmp, env)
    finally:
        kill_group(lighthouse)
        lh_log.close()
    want = 2 * (args.warmup + args.outer_steps)  # every outer step committed with both replicas in the quorum
    if any(r["commits"] != want for r in res):
        raise RuntimeError(f"torchft committed {[r['commits'] for r in res]} replica-steps, expected {want} each")
    inner = statistics.median(res[0]["inner"] + res[1]["inner"])
    steps = [max(a, b) - inner for a, b in zip(res[0]["sync_step"], res[1]["sync_step"], strict=True)]
    return {"sync": steps, "inner": inner, "vmhwm": max(r["vmhwm"] for r in res),
            "baseline": max(r["baseline"] for r in res)}


def measure_fedtrain(args: argparse.Namespace, tmp: Path, publish_first: bool = False) -> dict[str, Any]:
    cmd = worker_cmd(sys.executable, "fedtrain", args, publish_first=int(publish_first))
    (res,) = run_workers("fedtrain-pf" if publish_first else "fedtrain", [cmd], args.timeout, tmp)
    return res


def report(args: argparse.Namespace, version: str, gloo: dict, tft: dict, fed: dict, fed_pf: dict) -> None:
    model_bytes = args.params // args.tensors * args.tensors * 4
    ref = statistics.median(gloo["sync"])
    print(f"\nmodel: {args.params / 1e6:.0f}M fp32 parameters ({model_bytes / 1e6:.0f} MB) in {args.tensors} "
          f"tensors; 2 replicas on loopback; {args.outer_steps} outer steps each after {args.warmup} warm-up; "
          f"torchft sync_every={args.sync_every}; torchft/torch {version}; {os.cpu_count()} CPU cores")
    head = f"{'system':<44} {'s/outer step':>12} {'best s':>7} {'x gloo':>7} {'peak RSS x model':>17}"
    print(head)
    print("-" * len(head))

    def row(name: str, times: list[float], rss: str) -> None:
        med = statistics.median(times)
        print(f"{name:<44} {med:12.2f} {min(times):7.2f} {med / ref:7.2f} {rss:>17}")

    row("plain gloo all-reduce (torch.distributed)", gloo["sync"], "-")
    row(f"torchft {TORCHFT_VERSION} DiLoCo (lighthouse + gloo)", tft["sync"],
        f"{tft['vmhwm'] / model_bytes:.2f} replica")
    row("fedtrain DiLoCo via HTTP coordinator", fed["sync"],
        f"{fed['coordinator_vmhwm'] / model_bytes:.2f} coord.")
    prep = statistics.median(fed["participant_prep"])
    row("  + participant Δ, digest, copy-in", [t + prep for t in fed["sync"]], "-")
    row("fedtrain, publish_first", fed_pf["sync"], f"{fed_pf['coordinator_vmhwm'] / model_bytes:.2f} coord.")
    print()
    for name, f in (("fedtrain", fed), ("fedtrain publish_first", fed_pf)):
        ratio = statistics.median(f["sync"]) / statistics.median(tft["sync"])
        ratio_prep = (statistics.median(f["sync"]) + prep) / statistics.median(tft["sync"])
        print(f"{name} / torchft time per outer step: {ratio:.2f} (with participant-side prep {ratio_prep:.2f}); "
              f"goal <= 0.50 -> {'met' if ratio <= 0.5 else 'NOT met'}")
    print(f"torchft: median inner step {tft['inner']:.3f} s subtracted; replica interpreter + torch baseline "
          f"{tft['baseline'] / model_bytes:.2f} x model before the model was built. fedtrain participants are "
          f"client threads in one process (sync_throughput), so only the coordinator's RSS is shown.")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="25M parameters instead of 100M")
    p.add_argument("--setup", action="store_true", help=f"create {VENV} with torchft {TORCHFT_VERSION}, then run")
    p.add_argument("--params", type=float, default=None, help="model parameters (default 100e6, --quick 25e6)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--outer-steps", type=int, default=5, help="measured outer steps per system")
    p.add_argument("--warmup", type=int, default=3, help="outer steps per system run first and not measured")
    p.add_argument("--sync-every", type=int, default=4, help="torchft inner steps per outer step (H)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per system (default 300, full 900)")
    p.add_argument("--op-timeout", type=float, default=300, help="torchft/gloo collective and quorum timeout")
    p.add_argument("--worker", choices=["gloo", "torchft", "fedtrain"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--publish-first", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.params = int(args.params or (25e6 if args.quick else 100e6))
    args.timeout = args.timeout or (300 if args.quick else 900)
    return args


def main() -> None:
    args = parse()
    if args.worker:
        # A stuck worker leaves its stacks in the log the parent prints before killing it.
        faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=False)
        {"gloo": gloo_worker, "torchft": torchft_worker, "fedtrain": fedtrain_worker}[args.worker](args)
        return
    if args.setup:
        setup_venv()
    version = check_venv()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        try:
            print("plain gloo all-reduce ...", flush=True)
            gloo = measure_gloo(args, tmp)
            print("torchft DiLoCo ...", flush=True)
            tft = measure_torchft(args, tmp)
            print("fedtrain DiLoCo through the coordinator ...", flush=True)
            fed = measure_fedtrain(args, tmp)
            print("fedtrain DiLoCo through the coordinator, publish_first ...", flush=True)
            fed_pf = measure_fedtrain(args, tmp, publish_first=True)
        except RuntimeError as e:
            sys.exit(f"benchmark failed: {e}")
    report(args, version, gloo, tft, fed, fed_pf)


if __name__ == "__main__":
    main()
