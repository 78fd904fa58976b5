"""What hostile or broken clients cost a coordinator (issue #18, items 8 and 9; issue #30, items
4 to 7), side by side for one or more source trees.

    python benchmarks/hostile_clients.py                              # this tree
    python benchmarks/hostile_clients.py --tree /tmp/base --tree .    # a baseline beside this tree
    python benchmarks/hostile_clients.py --idle 500 --seconds 2       # quicker
    python benchmarks/hostile_clients.py --only pieces,rows,info,metrics,addresses --tree /tmp/base --tree .

(`git worktree add --detach /tmp/base main` makes a baseline tree.) For each tree and scenario a
coordinator runs in a subprocess (that tree's `src` first on its path) on a free 127.0.0.1 port,
over a temporary state directory and a 32 MB model; it is stopped at the end of the scenario.
Every step is bounded in count and time. Issue #30's scenarios, each in a fresh coordinator:

- `pieces`: `--pieces` pieces of `--piece-mb` of one participant's update (labels p0, p1, ...),
  each half sent and stalled: RSS, spool bytes, and the answers given while they stall (a piece
  still streaming in has none); half a piece of 4 MB (2.0 MB) is less than one 2 MiB receive
  batch, held in memory until full, so spool shows only from `--piece-mb 5`;
- `rows`: `--stalled-rows` downloads of all rows of version 0 whose clients stopped reading: RSS;
- `info`: `--cycles` joins (each with `--info-kb` of info) and departures under new names, and
  heartbeats of a participant with that info: RSS, run.db bytes, the heartbeat's time;
- `metrics`: `--reports` metric reports of `--values` values beside one /v1/stream subscriber
  that never reads: peak RSS;
- `addresses`: `--idle` idle connections from 127.0.0.1, then /v1/healthz from 127.0.0.2 and
  from 127.0.0.1: their answers and latency, and RSS.

The older ones (`classic`), in one coordinator:

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
import contextlib
import json
import os
import select
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
        self.state = work / "state"

    def bytes_under(self, name: str) -> int:
        """Bytes of the files in the state directory whose names start with `name` (run.db: with its WAL)."""
        root = self.state / name
        if root.is_dir():
            return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        return sum(f.stat().st_size for f in self.state.glob(f"{name}*") if f.is_file())

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


def connect(port: int, rcvbuf: int | None = None, source: str = "127.0.0.1") -> socket.socket:
    """A connection from loopback address `source` (127.0.0.2 etc. are this host too, on Linux)."""
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def head(method: str, path: str, extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: b\r\nauthorization: Bearer {TOKEN}\r\n{extra}\r\n".encode()


class PeakRss:
    """The coordinator's highest RSS (MB) while the block runs, sampled every 20 ms."""

    def __init__(self, c: Coordinator) -> None:
        self.c, self.peak, self._stop = c, c.rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.c.rss_mb())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def answered(socks: list[socket.socket]) -> str:
    """The status codes already answered on `socks` (a socket with nothing to read has none yet)."""
    ready, _, _ = select.select(socks, [], [], 0)
    codes: dict[str, int] = {}
    for s in ready:
        try:
            code = s.recv(1024).split(b" ", 2)[1].decode()
        except (OSError, IndexError):
            code = "closed"
        codes[code] = codes.get(code, 0) + 1
    none = len(socks) - len(ready)
    return ", ".join([f"{n}x {code}" for code, n in sorted(codes.items())] + [f"{none} unanswered"] * bool(none))


def join_as(http: httpx.Client, name: str, info: dict | None = None) -> tuple[int, dict[str, str]]:
    """Join as `name`: (the status, the headers that speak as it)."""
    r = http.post("/v1/join", json={"name": name, "info": info or {}, "key_cookie": False})
    key = r.json().get("participant_key", "") if r.status_code == 200 else ""
    return r.status_code, {"X-Fedtrain-Participant-Key": key}


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


def beside_stalled(c: Coordinator, n: int, wait_s: float) -> tuple[float | None, float | None, int]:
    """One download's seconds alone, and beside `n` downloads whose clients read nothing more;
    and how many of those `n` the coordinator took (one token may have at most
    MAX_DOWNLOAD_CONNECTIONS in flight: the rest are answered 429)."""
    alone = download_s(c, wait_s)
    stalled = []
    taken = 0
    try:
        for _ in range(n):
            s = connect(c.port, rcvbuf=1 << 16)
            s.sendall(f"GET /v1/model HTTP/1.1\r\nhost: b\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode())
            taken += s.recv(1024).startswith(b"HTTP/1.1 200")
            stalled.append(s)
        time.sleep(0.5)
        return alone, download_s(c, wait_s), taken
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
        alone, beside, taken = beside_stalled(c, args.stalled, args.wait)

    def secs(s: float | None) -> str:
        return f"{s:.2f} s" if s is not None else f"none in {args.wait:g} s"

    return {
        f"RSS before {args.idle} idle connections": f"{before:.0f} MB",
        f"RSS with {args.idle} idle connections": f"{during:.0f} MB",
        "RSS after they closed": f"{after:.0f} MB",
        "download, alone": secs(alone),
        f"download beside {args.stalled} stalled": secs(beside),
        "stalled downloads taken (the rest 429)": str(taken),
        "control ops/s, no subscriber": f"{quiet:.0f}",
        f"control ops/s, {args.subscribers} deaf subscribers": f"{noisy:.0f}",
        "slowdown from the subscribers": f"{quiet / noisy:.1f}x" if noisy else "stalled",
    }


# -- issue #30's scenarios, each in a fresh coordinator -------------------------------------------


def scenario_pieces(c: Coordinator, args: argparse.Namespace) -> dict[str, str]:
    """`--pieces` pieces of `--piece-mb` of one participant's update, each half sent, then stalled."""
    import torch

    from fedtrain.wire import DIGEST_HEADER, EncodedBody

    rows = min(args.piece_mb, args.model_mb) * 250_000
    spans = args.model_mb * 250_000 // rows  # pieces of disjoint rows, as far as the model goes
    with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        _, key = join_as(http, "pieces")
    before, socks, refused = c.rss_mb(), [], 0
    try:
        for i in range(args.pieces):
            span = json.dumps({"w": [i % spans * rows, (i % spans + 1) * rows]})
            body = EncodedBody({"w": torch.zeros(rows)}, {"fedtrain.rows": span})
            data = b"".join(bytes(v) for v in body)
            s = connect(c.port)
            extra = (f"{DIGEST_HEADER}: {body.digest()}\r\ncontent-length: {len(data)}\r\n"
                     f"x-fedtrain-participant-key: {key['X-Fedtrain-Participant-Key']}\r\n")
            try:
                s.sendall(head("PUT", f"/v1/rounds/0/updates/pieces?tokens=10&piece=p{i}", extra)
                          + data[: len(data) // 2])
            except OSError:
                refused += 1
            socks.append(s)
        time.sleep(1.0)
        during, spool, answers = c.rss_mb(), c.bytes_under("spool"), answered(socks)
    finally:
        close_all(socks)
    return {"RSS": f"+{during - before:.0f} MB", "spool": f"{spool / 2**20:.0f} MB", "answers": answers,
            "note": f"{args.pieces} half-sent pieces of {args.piece_mb} MB, {refused} cut off while sending"}


def scenario_rows(c: Coordinator, args: argparse.Namespace) -> dict[str, str]:
    """`--stalled-rows` downloads of all rows of version 0 whose clients read nothing more."""
    from urllib.parse import quote

    path = f"/v1/model?version=0&rows={quote(json.dumps({'w': [0, args.model_mb * 250_000]}))}"
    before, socks = c.rss_mb(), []
    try:
        for _ in range(args.stalled_rows):
            s = connect(c.port, rcvbuf=1 << 16)
            s.sendall(head("GET", path))
            s.recv(1024)
            socks.append(s)
        time.sleep(1.0)
        during = c.rss_mb()
    finally:
        close_all(socks)
    return {"RSS": f"+{during - before:.0f} MB", "note": f"{args.stalled_rows} stalled downloads of all rows"}


def scenario_info(c: Coordinator, args: argparse.Namespace) -> dict[str, str]:
    """`--cycles` joins with `--info-kb` of info and departures under new names; heartbeats."""
    big = {"host": "h", "blob": "x" * (args.info_kb << 10)}
    before, db_before, accepted = c.rss_mb(), c.bytes_under("run.db"), 0
    with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        for i in range(args.cycles):
            status, key = join_as(http, f"info{i}", big)
            if status == 200:
                accepted += 1
                http.post(f"/v1/participants/info{i}/leave", headers=key)
        status, key = join_as(http, "beating", big)
        if status != 200:  # refused: the largest info that is taken
            lo, hi = 0, args.info_kb << 10
            while hi - lo > 256:
                mid = (lo + hi) // 2
                status, key = join_as(http, "beating", {"host": "h", "blob": "x" * mid})
                lo, hi = (mid, hi) if status == 200 else (lo, mid)
            status, key = join_as(http, "beating", {"host": "h", "blob": "x" * lo})
        times = []
        for step in range(20):
            t0 = time.perf_counter()
            http.post("/v1/participants/beating/heartbeat", json={"step": step}, headers=key)
            times.append(time.perf_counter() - t0)
    times.sort()
    grown_db = (c.bytes_under("run.db") - db_before) / 2**20
    return {"RSS": f"+{c.rss_mb() - before:.0f} MB", "run.db": f"+{grown_db:.1f} MB",
            "heartbeat": f"{times[len(times) // 2] * 1000:.1f} ms",
            "note": f"{accepted} of {args.cycles} joins with {args.info_kb} KB of info taken"}


def scenario_metrics(c: Coordinator, args: argparse.Namespace) -> dict[str, str]:
    """`--reports` reports of `--values` values beside one /v1/stream subscriber that never reads."""
    deaf = connect(c.port, rcvbuf=1 << 12)
    deaf.sendall(head("GET", "/v1/stream"))
    values = {f"k{i}": 0.0 for i in range(args.values)}
    codes: dict[int, int] = {}
    with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        _, key = join_as(http, "metrics")
        before = c.rss_mb()
        with deaf, PeakRss(c) as peak:
            for _ in range(args.reports):
                code = http.post("/v1/participants/metrics/metrics", json={"values": values}, headers=key).status_code
                codes[code] = codes.get(code, 0) + 1
            time.sleep(0.5)
    answers = ", ".join(f"{n}x {code}" for code, n in sorted(codes.items()))
    return {"RSS": f"+{peak.peak - before:.0f} MB peak",
            "note": f"{args.reports} reports of {args.values:,} values: {answers}"}


def healthz(c: Coordinator, source: str, wait_s: float = 5.0) -> str:
    """The answer to /v1/healthz from `source`, and how long it took."""
    t0 = time.perf_counter()
    try:
        with connect(c.port, source=source) as s:
            s.settimeout(wait_s)
            s.sendall(head("GET", "/v1/healthz"))
            status = s.recv(1024).split(b" ", 2)[1].decode() or "closed"
    except (OSError, IndexError):
        status = "no answer"
    return f"{status} in {(time.perf_counter() - t0) * 1000:.0f} ms"


def scenario_addresses(c: Coordinator, args: argparse.Namespace) -> dict[str, str]:
    """`--idle` idle connections from 127.0.0.1; then /v1/healthz from another address and from it."""
    time.sleep(0.5)
    before, socks = c.rss_mb(), []
    try:
        for _ in range(args.idle):
            s = connect(c.port)
            with contextlib.suppress(OSError):  # closed by the server already
                s.sendall(b"GET /v1/healthz HTTP/1.1\r\n")  # read by the server, never completed
            socks.append(s)
        time.sleep(1.0)
        other, same, during = healthz(c, "127.0.0.2"), healthz(c, "127.0.0.1"), c.rss_mb()
    finally:
        close_all(socks)
    return {"RSS": f"+{during - before:.0f} MB", "healthz": f"{other} (other address); {same} (same)",
            "note": f"{args.idle} idle connections from 127.0.0.1"}


SCENARIOS = {"pieces": scenario_pieces, "rows": scenario_rows, "info": scenario_info,
             "metrics": scenario_metrics, "addresses": scenario_addresses}
COLUMNS = ("RSS", "spool", "answers", "run.db", "heartbeat", "healthz", "note")


def measure_issue30(tree: Path, args: argparse.Namespace, model: Path, names: list[str]) -> dict[str, dict[str, str]]:
    out = {}
    for name in names:
        with tempfile.TemporaryDirectory() as work, Coordinator(tree, Path(work), model) as c:
            out[name] = SCENARIOS[name](c, args)
    return out


def print_issue30(results: dict[str, dict[str, dict[str, str]]], names: list[str]) -> None:
    """One table per scenario: a row per tree, a column per measure it has."""
    for name in names:
        cols = [k for k in COLUMNS if any(k in r[name] for r in results.values())]
        rows = [[tree] + [r[name].get(k, "") for k in cols] for tree, r in results.items()]
        widths = [max(len(x) for x in col) for col in zip(["tree", *cols], *rows, strict=True)]
        print(f"\n{name}: {SCENARIOS[name].__doc__}")
        print("| " + " | ".join(h.ljust(w) for h, w in zip(["tree", *cols], widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row in rows:
            print("| " + " | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) + " |")


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
    p.add_argument("--pieces", type=int, default=100, help="half-sent pieces of one update (default 100)")
    p.add_argument("--piece-mb", type=int, default=4, help="size of each piece (default 4 MB)")
    p.add_argument("--stalled-rows", type=int, default=40, help="stalled downloads of all rows (default 40)")
    p.add_argument("--cycles", type=int, default=50, help="joins and departures with a large info (default 50)")
    p.add_argument("--info-kb", type=int, default=900, help="info of each join, KB (default 900)")
    p.add_argument("--reports", type=int, default=20, help="metric reports beside a deaf subscriber (default 20)")
    p.add_argument("--values", type=int, default=70_000, help="values in each metric report (default 70,000)")
    p.add_argument("--only", default="classic," + ",".join(SCENARIOS),
                   help=f"comma-separated scenarios: classic, {', '.join(SCENARIOS)} (default all)")
    args = p.parse_args()
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n != "classic" and n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios: {', '.join(unknown)}")
    names = [n for n in SCENARIOS if n in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.safetensors"
        write_model(model, args.model_mb)
        results, issue30 = {}, {}
        for tree in trees:
            print(f"measuring {tree} ...", file=sys.stderr, flush=True)
            if "classic" in chosen:
                results[str(tree)] = measure(tree, args, model)
            issue30[str(tree)] = measure_issue30(tree, args, model, names)
    if names:
        print_issue30(issue30, names)
    if not results:
        return
    rows = list(next(iter(results.values())))
    width = max(len(r) for r in rows)
    cols = [max(len(t), 16) for t in results]
    print(" " * width + "  " + "  ".join(t.rjust(w) for t, w in zip(results, cols, strict=True)))
    for row in rows:
        print(row.ljust(width) + "  " + "  ".join(results[t][row].rjust(w) for t, w in zip(results, cols, strict=True)))


if __name__ == "__main__":
    main()
