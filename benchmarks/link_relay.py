"""A userspace TCP relay that adds latency, for benchmarks/links.py (this kernel has no netem).

It runs in the middle namespace: it accepts each participant-side connection, opens one to the
coordinator, and in each direction holds every chunk it reads for RTT/2 before writing it on.
The link's rate stays the tbf shapers' (at both outer ends); the relay adds delay, not a limit.

What it emulates, and what not. The relay terminates TCP: each end's TCP sees a short-RTT
connection to the relay, so TCP's own window dynamics over the long RTT (slow start taking RTTs,
loss recovery, cwnd) are NOT reproduced. What it does reproduce is the bound that makes parallel
streams pay on a long path: a connection can have at most its window in flight per RTT. The relay
holds at most `window` x (RTT/2) / RTT = window/2 bytes of a connection in each direction's delay
line, so one connection moves at most window / RTT, as a real one with that window does. The
window defaults to this machine's largest TCP send buffer (`tcp_wmem` max), what autotuning lets
one connection reach. No loss, no jitter, no reordering.

    python link_relay.py --listen 10.0.2.1:8000 --to 10.0.1.1:8000 --rtt-ms 50 --window 4194304
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 256 * 1024


def default_window() -> int:
    return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


class DelayLine:
    """One direction of one connection: chunks read from `src`, written to `dst` `delay_s` later,
    at most `cap` bytes held."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, cap: int) -> None:
        self.src, self.dst, self.delay_s, self.cap = src, dst, delay_s, cap
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.closed = False
        self.cond = threading.Condition()

    def read(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.held >= self.cap:
                        self.cond.wait()
                data = self.src.recv(CHUNK)
                with self.cond:
                    self.queue.append((time.monotonic() + self.delay_s, data))
                    self.held += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            with self.cond:
                self.queue.append((time.monotonic() + self.delay_s, b""))
                self.cond.notify_all()

    def write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue:
                        self.cond.wait()
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.held -= len(data)
                    self.cond.notify_all()
        except OSError:
            for s in (self.src, self.dst):  # a reset on one side: pass it on as a close
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def serve(listen: tuple[str, int], to: tuple[str, int], rtt_ms: float, window: int) -> None:
    srv = socket.create_server(listen, backlog=128)
    print("relaying", flush=True)
    while True:
        a, _ = srv.accept()
        try:
            b = socket.create_connection(to, timeout=10)
        except OSError:
            a.close()
            continue
        b.settimeout(None)
        for x, y in ((a, b), (b, a)):
            line = DelayLine(x, y, rtt_ms / 2000, max(CHUNK, window // 2))
            threading.Thread(target=line.read, daemon=True).start()
            threading.Thread(target=line.write, daemon=True).start()


class Relay:
    """The relay process in the middle namespace of `link`, on `port` (both faces)."""

    def __init__(self, link: Any, port: int, rtt_ms: float, window: int) -> None:
        self.argv = link.exec_argv("R", [sys.executable, __file__, "--listen", f"{link.target_ip}:{port}", "--to",
                                         f"{link.coordinator_ip}:{port}", "--rtt-ms", str(rtt_ms),
                                         "--window", str(window)])
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Relay:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=_addr, required=True)
    p.add_argument("--to", type=_addr, required=True)
    p.add_argument("--rtt-ms", type=float, required=True)
    p.add_argument("--window", type=int, default=None)
    args = p.parse_args()
    serve(args.listen, args.to, args.rtt_ms, args.window or default_window())


if __name__ == "__main__":
    main()
