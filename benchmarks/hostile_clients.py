"""What hostile or broken clients cost a coordinator (issue #18, items 8 and 9), side by side for
one or more source trees.

    python benchmarks/hostile_clients.py                              # this tree
    python benchmarks/hostile_clients.py --tree /tmp/base --tree .    # a baseline beside this tree
    python benchmarks/hostile_clients.py --idle 500 --seconds 2       # quicker

For each tree a coordinator runs in a subprocess (that tree's `src` first on its path) on a free
127.0.0.1 port, over a temporary state directory and a 32 MB model; it is stopped at the end of
its measurements. Every step is bounded in count and time:

- RSS of the coordinator before, with and after `--idle` idle connections (each has sent the
  first line of a request, so that the server has read from it);
- the time of one download of the model, alone and beside `--stalled` downloads whose clients
  stopped reading (given up after `--wait` seconds);
- control throughput (rejoins of a few participants, each a status change and an event, from
  two threads for `--seconds`, the best of `--repeat` runs) with no server-sent-event
  subscriber, and with `--subscribers` that never read.
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

TOKEN = "participant-token"
CONFIG = {
    "name": "hostile", "rounds": 3, "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 3600.0,
    "train": {"sync_every": 5, "seq_len": 32, "batch_size": 8, "eval_batches": 2, "lr": 3e-3},
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
}
SERVER = r"""
import json, sys
from pathlib import Path
from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.transport.allocator import tune_process

tune_process()  # as `fedtrain coordinator` does
state, init, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with BackgroundCoordinator(state, RunConfig.model_validate(config), tokens=Tokens([sys.argv[4]], "admin"),
                           init_weights=Path(init)) as c:
    print(c.port, flush=True)
    sys.stdin.read()  # until the benchmark closes it
"""


def write_model(path: Path, mb: int) -> None:
    import torch

    from fedtrain.wire import write_file

    write_file(path, {"w": torch.randn(mb * 250_000, generator=torch.Generator().manual_seed(0))})


class Coordinator:
    """A coordinator of `tree` in a subprocess, stopped on exit."""

    def __init__(self, tree: Path, work: Path, model: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(work / "state"), str(model), json.dumps(CONFIG), TOKEN],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def idle_rss(c: Coordinator, n: int) -> tuple[float, float, float]:
    """RSS (MB) before, with `n` idle connections open, and after they closed."""
    time.sleep(0.5)
    before = c.rss_mb()
    socks = []
    try:
        for _ in range(n):
            s = connect(c.port)
            s.sendall(b"GET /v1/healthz HTTP/1.1\r\n")  # read by the server, never completed
            socks.append(s)
        time.sleep(1.0)
        during = c.rss_mb()
    finally:
        for s in socks:
            s.close()
    time.sleep(1.0)
    return before, during, c.rss_mb()


def download_s(c: Coordinator, wait_s: float) -> float | None:
    """Seconds for one whole download of the model; None if not done within `wait_s`."""
    t0 = time.perf_counter()
    try:
        with httpx.stream("GET", f"{c.url}/v1/model", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=httpx.Timeout(wait_s)) as r:
            for _ in r.iter_raw():
                if time.perf_counter() - t0 > wait_s:
                    return None
    except httpx.TimeoutException:
        return None
    return time.perf_counter() - t0


def beside_stalled(c: Coordinator, n: int, wait_s: float) -> tuple[float | None, float | None]:
    """One download's seconds alone, and beside `n` downloads whose clients read nothing more."""
    alone = download_s(c, wait_s)
    stalled = []
    try:
        for _ in range(n):
            s = connect(c.port, rcvbuf=1 << 16)
            s.sendall(f"GET /v1/model HTTP/1.1\r\nhost: b\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode())
            s.recv(1024)
            stalled.append(s)
        time.sleep(0.5)
        return alone, download_s(c, wait_s)
    finally:
        for s in stalled:
            s.close()


def control_ops(c: Coordinator, seconds: float, subscribers: int) -> float:
    """Rejoins per second (each a status change) from two threads, beside `subscribers` that never read."""
    deaf = []
    for _ in range(subscribers):
        s = connect(c.port, rcvbuf=1 << 12)
        s.sendall(f"GET /v1/stream HTTP/1.1\r\nhost: b\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode())
        deaf.append(s)
    time.sleep(0.5)
    done = [0, 0]
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            while time.perf_counter() < stop:
                http.post("/v1/join", json={"name": f"p{i}-{done[i] % 4}"}).raise_for_status()
                done[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 60)
    finally:
        for s in deaf:
            s.close()
    return sum(done) / seconds


def measure(tree: Path, args: argparse.Namespace, model: Path) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as work, Coordinator(tree, Path(work), model) as c:
        before, during, after = idle_rss(c, args.idle)
        quiet = noisy = 0.0
        for _ in range(args.repeat):  # in turn, so that a busy moment of the machine falls on both
            quiet = max(quiet, control_ops(c, args.seconds, 0))
            noisy = max(noisy, control_ops(c, args.seconds, args.subscribers))
        alone, beside = beside_stalled(c, args.stalled, args.wait)

    def secs(s: float | None) -> str:
        return f"{s:.2f} s" if s is not None else f"none in {args.wait:g} s"

    return {
        f"RSS before {args.idle} idle connections": f"{before:.0f} MB",
        f"RSS with {args.idle} idle connections": f"{during:.0f} MB",
        "RSS after they closed": f"{after:.0f} MB",
        "download, alone": secs(alone),
        f"download beside {args.stalled} stalled": secs(beside),
        "control ops/s, no subscriber": f"{quiet:.0f}",
        f"control ops/s, {args.subscribers} deaf subscribers": f"{noisy:.0f}",
        "slowdown from the subscribers": f"{quiet / noisy:.1f}x" if noisy else "stalled",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, action="append", help="a source tree (repeat; default: this one)")
    p.add_argument("--idle", type=int, default=2000, help="idle connections (default 2000)")
    p.add_argument("--stalled", type=int, default=70, help="stalled downloads (default 70)")
    p.add_argument("--subscribers", type=int, default=100, help="SSE subscribers that never read (default 100)")
    p.add_argument("--seconds", type=float, default=4.0, help="duration of each throughput run (default 4)")
    p.add_argument("--repeat", type=int, default=3, help="throughput runs of each kind; the best counts (default 3)")
    p.add_argument("--wait", type=float, default=20.0, help="longest wait for one download (default 20 s)")
    p.add_argument("--model-mb", type=int, default=32, help="size of the model (default 32 MB)")
    args = p.parse_args()
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.safetensors"
        write_model(model, args.model_mb)
        results = {}
        for tree in trees:
            print(f"measuring {tree} ...", file=sys.stderr, flush=True)
            results[str(tree)] = measure(tree, args, model)
    rows = list(next(iter(results.values())))
    width = max(len(r) for r in rows)
    cols = [max(len(t), 16) for t in results]
    print(" " * width + "  " + "  ".join(t.rjust(w) for t, w in zip(results, cols, strict=True)))
    for row in rows:
        print(row.ljust(width) + "  " + "  ".join(results[t][row].rjust(w) for t, w in zip(results, cols, strict=True)))


if __name__ == "__main__":
    main()
