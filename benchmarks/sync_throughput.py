"""Sync throughput and coordinator memory, through a real coordinator on loopback.

    python benchmarks/sync_throughput.py                 # 100M-parameter fp32 model, N = 1 and 4
    python benchmarks/sync_throughput.py --quick         # 25M parameters, ~1 minute
    python benchmarks/sync_throughput.py --memory        # peak RSS, 400 MB model, N = 1, 2, 4, 8
    python benchmarks/sync_throughput.py --gap 2         # rounds 2 s apart, as between real syncs

Throughput: N client threads each upload a pseudo-gradient (the participant's own
`CoordinatorClient.upload` path: zero-copy 1 MiB chunks), the coordinator verifies,
spools, folds and runs the outer step (DiLoCo), then every client downloads the new
global model (`CoordinatorClient.download`, straight into preallocated tensors). A round
trip moves 2 x N x model bytes; it is compared with a raw loopback TCP copy of the same
bytes measured in the same run (the fastest of 3 copies before and 3 after the rounds).
The first `--warmup` rounds (3) are not measured: connections, and the coordinator's first
checkpoints, which go to fresh files until it has spares to write over. Then `--rounds`
(5) are, and the best and the median are reported. Rounds run back to back unless `--gap` leaves time
between them, as the inner steps of a real run do: with `publish_first` that is when the
previous round's checkpoint is written, so the round trip is then upload, merge, download.

Memory: the coordinator runs in its own process; its peak RSS (VmHWM) after N clients
uploaded into the same round, divided by the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from fedtrain.participant import CoordinatorClient
from fedtrain.wire import EncodedBody, write_file

HOST = "127.0.0.1"
TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def make_model(params: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = params // tensors
    return {f"layer{i}.weight": torch.randn(per, generator=g) * 0.02 for i in range(tensors)}


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 120.0) -> None:
    """Wait until something listens on `port`; fail early if `proc` (what starts it) exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}) before listening") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not listening on port {port} after {timeout_s:.0f} s") from None
            time.sleep(0.1)


def start_coordinator(tmp: Path, init: Path, n: int, extra: dict | None = None,
                      env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    cfg = {"name": "bench", "rounds": 0, "min_participants": n, "round_timeout_s": 3600,
           "heartbeat_interval_s": 30, "heartbeat_timeout_s": 3600, "keep_checkpoints": 1,
           "max_upload_mb": 100_000, **(extra or {})}
    (tmp / "run.json").write_text(json.dumps(cfg))
    port = free_port()
    env = {**os.environ, "FEDTRAIN_TOKEN": TOKEN, "FEDTRAIN_ADMIN_TOKEN": "bench-admin", **(env_extra or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedtrain", "--log-level", "warning", "coordinator", "--config", str(tmp / "run.json"),
         "--state-dir", str(tmp / "state"), "--port", str(port), "--init-weights", str(init)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{url}/v1/healthz", timeout=2)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("coordinator did not start") from None
            time.sleep(0.2)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def raw_tcp_seconds(body: EncodedBody, copies: int) -> float:
    """Seconds to push `copies` x body through one loopback TCP connection."""
    with socket.create_server((HOST, 0)) as srv:
        port = srv.getsockname()[1]

        def sink() -> None:
            conn, _ = srv.accept()
            buf = bytearray(1 << 20)
            with conn:
                while conn.recv_into(buf):
                    pass

        t = threading.Thread(target=sink)
        t.start()
        t0 = time.perf_counter()
        with socket.create_connection((HOST, port)) as s:
            for _ in range(copies):
                for chunk in body:
                    s.sendall(chunk)
        t.join()
        return time.perf_counter() - t0


def run_rounds(url: str, n: int, model: dict[str, torch.Tensor], rounds: int, download: bool = True,
               gap_s: float = 0.0) -> list[float]:
    """Seconds per round trip (all uploads start together; ends when every client holds the
    new model); `gap_s` between rounds stands for the participants' inner steps."""
    delta = {k: torch.full_like(v, 1e-4) for k, v in model.items()}
    body = EncodedBody(delta)
    body.digest()  # computed once, like a participant does before sending
    clients = [CoordinatorClient(url, TOKEN) for _ in range(n)]
    pids = [c.join(f"bench{i}")["participant_id"] for i, c in enumerate(clients)]
    buffers = [{k: torch.empty_like(v) for k, v in model.items()} for _ in range(n if download else 0)]
    times: list[float] = []
    for r in range(rounds):
        barrier = threading.Barrier(n + 1)
        errors: list[BaseException] = []

        def one(i: int, r: int = r, barrier: threading.Barrier = barrier, errors: list = errors) -> None:
            try:
                barrier.wait()
                clients[i].upload(r, pids[i], body, tokens=1000)
                while clients[i].wait_round(r, pids[i], wait_s=30)["state"] in ("open", "closing"):
                    pass
                if download:
                    clients[i].download(pid=pids[i], allocate=lambda s, i=i: buffers[i][s.name])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
        if errors:
            raise errors[0]
        time.sleep(gap_s)
    for c in clients:
        c.close()
    return times


def throughput(args: argparse.Namespace) -> None:
    params = int(args.params or (25e6 if args.quick else 100e6))
    model = make_model(params, args.tensors)
    model_bytes = sum(v.numel() * 4 for v in model.values())
    print(f"model: {params / 1e6:.0f}M fp32 parameters ({model_bytes / 1e6:.0f} MB) in {args.tensors} tensors; "
          f"outer optimizer DiLoCo; {args.rounds} rounds after {args.warmup} warm-up, best round reported "
          "(median alongside)")
    print("commit (the default): each round's model is sent while its checkpoint is written, downloads end once "
          "it is fsync'd and committed; publish_first: downloads end at once, checkpoint written after them")
    print(f"rounds {'back to back' if not args.gap else f'{args.gap:g} s apart (the inner steps of a real run)'}")
    print(f"{'N':>3} {'mode':<14} {'round s':>8} {'median':>7} {'MB/s':>7} {'raw TCP MB/s':>13} {'ratio':>6}")
    modes = {"commit": {}, "publish_first": {"publish_first": True}}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        init = tmp / "init.safetensors"
        write_file(init, model)
        for n in args.participants:
            moved = 2 * n * model_bytes
            for mode in args.modes:
                run_dir = tmp / f"n{n}-{mode}"
                run_dir.mkdir()
                # The reference is the fastest raw copy seen just before and just after the
                # rounds: one taken at a slow moment of this shared machine would flatter the ratio.
                raw = min(raw_tcp_seconds(EncodedBody(model), 2 * n) for _ in range(3))
                proc, url = start_coordinator(run_dir, init, n, modes[mode])
                try:
                    times = sorted(run_rounds(url, n, model, args.warmup + args.rounds, gap_s=args.gap)[args.warmup:])
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                raw = min(raw, *(raw_tcp_seconds(EncodedBody(model), 2 * n) for _ in range(3)))
                best, median = times[0], times[len(times) // 2]
                print(f"{n:>3} {mode:<14} {best:8.2f} {median:7.2f} {moved / best / 1e6:7.0f} "
                      f"{moved / raw / 1e6:13.0f} {raw / best:6.2f}")


def direct_compare(args: argparse.Namespace) -> None:
    """The round trip with and without the direct receive (the round's first upload read
    straight into the running sum), alternating in one invocation (issue #29)."""
    params = int(args.params or (25e6 if args.quick else 100e6))
    model = make_model(params, args.tensors)
    model_bytes = sum(v.numel() * 4 for v in model.values())
    print(f"model: {params / 1e6:.0f}M fp32 parameters ({model_bytes / 1e6:.0f} MB); direct receive on and off, "
          f"alternating, {args.repeat} times; each figure: best of {args.rounds} rounds after {args.warmup} warm-up")
    print(f"{'N':>3} {'mode':<14} {'direct':<7} {'rep':>3} {'round s':>8} {'median':>7} {'ratio':>6}")
    modes = {"commit": {}, "publish_first": {"publish_first": True}}
    best_of: dict[tuple[int, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        init = tmp / "init.safetensors"
        write_file(init, model)
        for n in args.participants:
            for mode in args.modes:
                for rep in range(args.repeat):
                    for direct in ("on", "off"):
                        run_dir = tmp / f"n{n}-{mode}-{direct}-{rep}"
                        run_dir.mkdir()
                        raw = min(raw_tcp_seconds(EncodedBody(model), 2 * n) for _ in range(3))
                        env = {"FEDTRAIN_DIRECT_RECEIVE": "1" if direct == "on" else "0"}
                        proc, url = start_coordinator(run_dir, init, n, modes[mode], env)
                        try:
                            times = sorted(run_rounds(url, n, model, args.warmup + args.rounds,
                                                      gap_s=args.gap)[args.warmup:])
                        finally:
                            proc.terminate()
                            proc.wait(timeout=30)
                        raw = min(raw, *(raw_tcp_seconds(EncodedBody(model), 2 * n) for _ in range(3)))
                        best, median = times[0], times[len(times) // 2]
                        best_of.setdefault((n, mode, direct), []).append(best)
                        print(f"{n:>3} {mode:<14} {direct:<7} {rep:>3} {best:8.2f} {median:7.2f} {raw / best:6.2f}",
                              flush=True)
    print("median over repetitions of the best round, s: direct on / off (off / on - 1)")
    for n in args.participants:
        for mode in args.modes:
            on = sorted(best_of[(n, mode, "on")])[args.repeat // 2]
            off = sorted(best_of[(n, mode, "off")])[args.repeat // 2]
            print(f"{n:>3} {mode:<14} {on:.3f} / {off:.3f} ({off / on - 1:+.1%})")


def memory(args: argparse.Namespace) -> None:
    params = int(args.params or (25e6 if args.quick else 100e6))
    model = make_model(params, args.tensors)
    model_bytes = sum(v.numel() * 4 for v in model.values())
    print(f"model: {model_bytes / 1e6:.0f} MB fp32 in {args.tensors} tensors; DiLoCo (master + momentum + sum)")
    print(f"{'N':>3} {'peak RSS MB':>12} {'x model':>8}")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        init = tmp / "init.safetensors"
        write_file(init, model)
        for n in args.participants:
            run_dir = tmp / f"n{n}"
            run_dir.mkdir()
            proc, url = start_coordinator(run_dir, init, n)
            try:
                run_rounds(url, n, model, 1, download=False)
                rss = peak_rss(proc.pid)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            print(f"{n:>3} {rss / 1e6:12.0f} {rss / model_bytes:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="25M parameters")
    p.add_argument("--memory", action="store_true", help="measure coordinator peak RSS instead")
    p.add_argument("--params", type=float, default=None, help="model parameters (default 100e6; memory: 100e6)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="rounds run first and not measured (default 3: until the coordinator has spare "
                        "checkpoint files to write over, its rounds are slower)")
    p.add_argument("--participants", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between rounds, as participants train between syncs (default 0: back to back)")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["commit", "publish_first"],
                   help="commit,publish_first (default: both)")
    p.add_argument("--direct-compare", action="store_true",
                   help="round trip with the direct receive into the sum on and off, alternating")
    p.add_argument("--repeat", type=int, default=3, help="--direct-compare: repetitions of each (default 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.direct_compare:
        args.participants = args.participants or [1]
        direct_compare(args)
    elif args.memory:
        args.participants = args.participants or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
        memory(args)
    else:
        args.participants = args.participants or [1, 4]
        throughput(args)


if __name__ == "__main__":
    main()
