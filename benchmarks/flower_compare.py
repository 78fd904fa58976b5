"""Side by side with Flower: round time and server peak memory, same model and clients.

    python benchmarks/flower_compare.py --setup     # create the Flower virtualenv, then exit
    python benchmarks/flower_compare.py --quick     # 25M fp32 parameters (100 MB), N = 1 and 4, 3 rounds
    python benchmarks/flower_compare.py             # 100M fp32 parameters (400 MB), N = 1 and 4, 3 rounds

Both sides run FedAvg over the same model (fp32, `--tensors` tensors) with N clients on
loopback, and measure the sync path only (no training):

* fedtrain: the real coordinator (`outer: {algorithm: fedavg}`) in its own process; N
  client threads upload a delta, the coordinator folds it and steps, every client
  downloads the new model (`sync_throughput.run_rounds`).
* Flower (`flwr`, legacy API): `fl.server.start_server` with FedAvg, insecure gRPC, and N
  `fl.client.start_client` processes whose NumPyClient.fit returns the parameters plus a
  constant at once. A round is timed from the end of configure_fit (clients sampled) to
  the end of aggregate_fit, inside the server. Flower pins fastapi, starlette and uvicorn,
  so it runs from its own plain virtualenv (`.benchmarks/flwr-venv`, numpy clients: the
  legacy API speaks numpy ndarrays, no torch needed there).

A round moves 2 x N x model bytes either way; both are compared with a raw loopback TCP
copy of the same bytes in the same run (best of 3). Server peak RSS is VmHWM of the coordinator
process, and of the Flower server process read by itself after its last round. Absolute
times drift on a shared machine; the ratios, taken in one run, are the figures to quote.

Memory: Flower's side is skipped (with a message) where its estimated peak does not fit in
90% of MemAvailable; at 400 MB and N = 4 it needs ~35 GB (server ~34 x model, each client
~12.5 x model), so on a 24 GiB machine run N = 4 with `--params 40e6` (~15 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_throughput import (
    HOST,
    free_port,
    make_model,
    peak_rss,
    raw_tcp_seconds,
    run_rounds,
    start_coordinator,
    wait_port,
)

from fedtrain.wire import EncodedBody, write_file

FLWR_VERSION = "1.42.0"
DEFAULT_VENV = Path(__file__).resolve().parent.parent / ".benchmarks" / "flwr-venv"
SETUP_TIMEOUT_S = 1200
START_TIMEOUT_S = 120

# Runs under the Flower venv's python: `flower_side.py server ADDR N PARAMS TENSORS ROUNDS MAXMSG`
# or `flower_side.py client ADDR MAXMSG`. Prints one JSON line (round times, VmHWM) at the end.
FLOWER_SIDE = r'''
import json, sys, time
import numpy as np
import flwr as fl
from flwr.common import ndarrays_to_parameters

def vmhwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1

mode, addr = sys.argv[1], sys.argv[2]
if mode == "server":
    n, params, tensors, rounds, maxmsg = (int(x) for x in sys.argv[3:8])
    rng = np.random.default_rng(0)
    per = params // tensors
    times, failures = [], []

    class TimedFedAvg(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            out = super().configure_fit(server_round, parameters, client_manager)
            self.t0 = time.perf_counter()  # after sampling: waiting for clients to connect is not a round
            return out

        def aggregate_fit(self, server_round, results, fail):
            out = super().aggregate_fit(server_round, results, fail)
            times.append(time.perf_counter() - self.t0)
            failures.append(len(fail))
            return out

    init = ndarrays_to_parameters([rng.standard_normal(per, dtype=np.float32) * 0.02 for _ in range(tensors)])
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=n,
                           min_available_clients=n, initial_parameters=init, accept_failures=False)
    del init
    fl.server.start_server(server_address=addr, strategy=strategy, grpc_max_message_length=maxmsg,
                           config=fl.server.ServerConfig(num_rounds=rounds, round_timeout=600.0))
    print(json.dumps({"round_s": times, "failures": failures, "peak_rss": vmhwm()}), flush=True)
else:
    maxmsg = int(sys.argv[3])

    class Echo(fl.client.NumPyClient):
        def get_parameters(self, config):
            return []

        def fit(self, parameters, config):
            return [np.add(p, np.float32(1e-4)) for p in parameters], 1000, {}

        def evaluate(self, parameters, config):
            return 0.0, 1, {}

    fl.client.start_client(server_address=addr, client=Echo().to_client(), grpc_max_message_length=maxmsg,
                           insecure=True, max_retries=20, max_wait_time=120.0)
    print(json.dumps({"peak_rss": vmhwm()}), flush=True)
'''


@dataclass
class Result:
    system: str
    rounds: list[float]
    peak_rss: int | None = None
    note: str = ""

    @property
    def best(self) -> float:
        return min(self.rounds)


# ---------------------------------------------------------------- Flower venv


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def flwr_version(venv: Path) -> str | None:
    py = venv_python(venv)
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import flwr, numpy; print(flwr.__version__)"],
                       capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else None


def setup_venv(venv: Path) -> None:
    """Create a plain virtualenv (no system site-packages: flwr pins fastapi/starlette/uvicorn) with flwr."""
    if flwr_version(venv) == FLWR_VERSION:
        print(f"Flower venv ready: {venv} (flwr {FLWR_VERSION})")
        return
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "-q",
              f"flwr=={FLWR_VERSION}"]]
    for cmd in steps:
        print("setup:", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
        if r.returncode != 0:
            raise SystemExit(f"setup failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    got = flwr_version(venv)
    if got != FLWR_VERSION:
        raise SystemExit(f"setup: {venv} does not import flwr {FLWR_VERSION} (got {got!r})")
    print(f"Flower venv ready: {venv} (flwr {got})")


# ---------------------------------------------------------------- processes


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def last_json(path: Path) -> dict | None:
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_flower(venv: Path, tmp: Path, n: int, params: int, tensors: int, rounds: int, timeout_s: float) -> Result:
    """One Flower server and n clients, each its own process under the venv's python."""
    script = tmp / "flower_side.py"
    script.write_text(FLOWER_SIDE)
    py = str(venv_python(venv))
    port = free_port()
    addr = f"{HOST}:{port}"
    maxmsg = min(2**31 - 1, params * 4 + (64 << 20))
    logs = [tmp / f"flwr-server-n{n}.log"] + [tmp / f"flwr-client{i}-n{n}.log" for i in range(n)]
    procs: list[subprocess.Popen] = []
    try:
        with open(logs[0], "w") as out:
            procs.append(subprocess.Popen([py, str(script), "server", addr, str(n), str(params), str(tensors),
                                           str(rounds), str(maxmsg)], stdout=out, stderr=subprocess.STDOUT))
        wait_port(port, procs[0], "Flower server", START_TIMEOUT_S)
        for i in range(n):
            with open(logs[i + 1], "w") as out:
                procs.append(subprocess.Popen([py, str(script), "client", addr, str(maxmsg)],
                                              stdout=out, stderr=subprocess.STDOUT))
        try:
            procs[0].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Flower N={n} did not finish {rounds} rounds in {timeout_s:.0f} s; server log:\n"
                               f"{tail(logs[0])}") from None
        server = last_json(logs[0])
        if procs[0].returncode != 0 or server is None:
            raise RuntimeError(f"Flower server failed ({procs[0].returncode}); log:\n{tail(logs[0])}")
        if any(server["failures"]) or len(server["round_s"]) != rounds:
            raise RuntimeError(f"Flower rounds failed: {server}; log:\n{tail(logs[0])}")
        for p in procs[1:]:
            p.wait(timeout=60)
        clients = [last_json(log) for log in logs[1:]]
        client_peak = max((c or {}).get("peak_rss", 0) for c in clients)
        return Result("Flower", server["round_s"], server["peak_rss"],
                      note=f"client peak RSS {client_peak / 1e9:.2f} GB")
    finally:
        for p in procs:
            stop(p)


# ---------------------------------------------------------------- fedtrain


def run_fedtrain(tmp: Path, init: Path, n: int, model: dict[str, torch.Tensor], rounds: int,
                 publish_first: bool = False) -> Result:
    run_dir = tmp / f"fedtrain-n{n}"
    run_dir.mkdir()
    proc, url = start_coordinator(run_dir, init, n, {"outer": {"algorithm": "fedavg"}, "publish_first": publish_first})
    try:
        times = run_rounds(url, n, model, rounds)
        return Result("fedtrain", times, peak_rss(proc.pid))
    finally:
        stop(proc)


# ---------------------------------------------------------------- memory guard


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def flower_needs(n: int, model_bytes: int) -> int:
    """Rough peak of the Flower side, measured here with flwr 1.42: the server ~(2 + 8 N) x model, each
    client ~12.5 x model (received message, decoded arrays, result, encoded result), ~0.25 GB per interpreter."""
    return int((2 + 8 * n) * model_bytes + n * 12.5 * model_bytes + (n + 1) * 0.25e9)


# ---------------------------------------------------------------- report


def print_table(rows: list[tuple[int, Result]], raw: dict[int, float], model_bytes: int) -> None:
    print(f"{'N':>3} {'system':<9} {'round s':>8} {'median s':>9} {'MB/s':>7} {'x slower than raw':>18} "
          f"{'server peak GB':>15} {'x model':>8}")
    for n, r in rows:
        moved = 2 * n * model_bytes
        if r.system == "raw TCP":
            print(f"{n:>3} {r.system:<9} {r.best:8.2f} {'':>9} {moved / r.best / 1e6:7.0f} {1.0:18.1f}")
            continue
        if not r.rounds:
            print(f"{n:>3} {r.system:<9} {'-':>8} {'':>9} {'':>7} {'':>18} {'':>15} {'':>8}  {r.note}")
            continue
        mem = (f"{r.peak_rss / 1e9:15.2f} {r.peak_rss / model_bytes:8.2f}" if r.peak_rss
               else f"{'-':>15} {'-':>8}")
        print(f"{n:>3} {r.system:<9} {r.best:8.2f} {statistics.median(r.rounds):9.2f} {moved / r.best / 1e6:7.0f} "
              f"{r.best / raw[n]:18.1f} {mem}  {r.note}".rstrip())


def print_ratios(rows: list[tuple[int, Result]]) -> None:
    print("\nfedtrain vs Flower, same run, best rounds: throughput = Flower round s / fedtrain round s; "
          "memory = fedtrain server peak / Flower server peak")
    print(f"{'N':>3} {'throughput':>11} {'memory':>7}")
    for n in sorted({n for n, _ in rows}):
        by = {r.system: r for m, r in rows if m == n}
        ft, fl = by.get("fedtrain"), by.get("Flower")
        if not (ft and fl and ft.rounds and fl.rounds):
            continue
        mem = f"{ft.peak_rss / fl.peak_rss:7.2f}" if ft.peak_rss and fl.peak_rss else f"{'-':>7}"
        print(f"{n:>3} {fl.best / ft.best:10.1f}x {mem}")


# ---------------------------------------------------------------- main


def compare(args: argparse.Namespace) -> None:
    params = int(args.params or (25e6 if args.quick else 100e6))
    model = make_model(params, args.tensors)
    model_bytes = sum(v.numel() * 4 for v in model.values())
    print(f"model: {params / 1e6:.0f}M fp32 parameters ({model_bytes / 1e6:.0f} MB) in {args.tensors} tensors; "
          f"FedAvg; {args.rounds} rounds per system, best round reported (median alongside); flwr {FLWR_VERSION} "
          f"legacy API, insecure gRPC; loopback; {os.cpu_count()} CPUs; fedtrain "
          f"{'publish_first' if args.publish_first else 'serves each model once committed'}", flush=True)
    rows: list[tuple[int, Result]] = []
    raw: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="flower-compare-") as tmp_s:
        tmp = Path(tmp_s)
        init = tmp / "init.safetensors"
        write_file(init, model)
        for n in args.participants:
            raw[n] = min(raw_tcp_seconds(EncodedBody(model), 2 * n) for _ in range(3))  # noisy on a shared box
            rows.append((n, Result("raw TCP", [raw[n]])))
            print(f"  N={n}: raw TCP {raw[n]:.2f} s; fedtrain ...", flush=True)
            rows.append((n, run_fedtrain(tmp, init, n, model, args.rounds, args.publish_first)))
            need, avail = flower_needs(n, model_bytes), mem_available()
            if need > 0.9 * avail and not args.force:
                rows.append((n, Result("Flower", [], note=f"skipped: needs ~{need / 1e9:.0f} GB, "
                                                          f"{avail / 1e9:.0f} GB available (--force runs it)")))
                continue
            print(f"  N={n}: fedtrain best {rows[-1][1].best:.2f} s; Flower ...", flush=True)
            flower_dir = tmp / f"flower-n{n}"
            flower_dir.mkdir()
            rows.append((n, run_flower(args.venv, flower_dir, n, params, args.tensors, args.rounds, args.timeout)))
    print()
    print_table(rows, raw, model_bytes)
    print_ratios(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="25M parameters")
    p.add_argument("--setup", action="store_true", help="create the Flower venv if missing, then exit")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"Flower virtualenv (default {DEFAULT_VENV})")
    p.add_argument("--params", type=float, default=None, help="model parameters (default 100e6; --quick 25e6)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--participants", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for one Flower run (all rounds)")
    p.add_argument("--force", action="store_true", help="run Flower even where it may not fit in memory")
    p.add_argument("--publish-first", action="store_true",
                   help="run the coordinator with publish_first (default: each model served once committed)")
    args = p.parse_args()
    if args.setup:
        setup_venv(args.venv)
        return
    if flwr_version(args.venv) != FLWR_VERSION:
        print(f"Flower venv {args.venv} missing or without flwr {FLWR_VERSION}; creating it "
              f"(a plain venv, `pip install flwr=={FLWR_VERSION}`) ...", flush=True)
        setup_venv(args.venv)
    torch.set_num_threads(1)
    compare(args)


if __name__ == "__main__":
    main()
