"""The shaped link of benchmarks/links.py: network namespaces joined by veth pairs, `tc tbf` on
both directions, byte counters read from the veths, and the faults injected on them.

Two namespaces, coordinator side (`C`) and participant side (`P`), on one veth pair; with a
latency relay a third (`R`) sits between them on two pairs, and the relay (link_relay.py) joins
the two halves. Every name starts with PREFIX, so that `cleanup_leftovers()` finds what a crashed
run left behind. Needs root and `ip netns`; `check_support()` says why not, in one line.

Faults: `reset()` aborts the busiest TCP connection at both ends (`ss -K`: each end sends a RST),
as a middlebox reset does; `silence()` drops every packet arriving at both ends (iptables INPUT
DROP), so the link goes quiet without an error for either side. This kernel has no netem, so no
latency or loss in the kernel: latency comes from the relay, loss is not emulated.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "fdlk"
NETS = {"CP": "10.231.0", "CR": "10.231.1", "RP": "10.231.2"}


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


def check_support() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"{PREFIX}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def cleanup_leftovers() -> list[str]:
    """Remove the namespaces (and stop the processes in them) that an earlier run of ours left
    behind; those of a run still going (its pid is in the name) are left alone."""
    out = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]
    left = [n for n in names if n != f"{PREFIX}-probe" and not _run_alive(n)]
    for name in left:
        _delete_ns(name)
    return left


def _run_alive(name: str) -> bool:
    """Whether the run that made namespace `name` (fdlk-PID-SIDE) is still going."""
    try:
        pid = int(name.split("-")[1])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ValueError, IndexError, OSError):
        return False
    return b"links.py" in cmdline


def _delete_ns(name: str) -> None:
    pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:  # processes of our own run, started in this namespace
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    sh("ip", "netns", "del", name, check=False)


def tbf_burst(rate_bit: float) -> int:
    """tbf's bucket: 2 ms at the rate, at least 64 KiB. A 64 KiB bucket at 1 Gbit/s (0.5 ms)
    caps one raw TCP stream at ~0.86 of the rate here; 2 ms lets it reach the wire's ~0.96."""
    return max(64 * 1024, int(rate_bit / 8 * 0.002))


@dataclass
class Link:
    """The namespaces of one run: `up()` makes them, `down()` removes them (always call it)."""

    rate_bit: float
    relay: bool = False
    burst: int | None = None  # tbf's bucket in bytes (None: tbf_burst(rate))
    run_id: str = field(default_factory=lambda: str(os.getpid()))
    holders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def ns(self, side: str) -> str:
        return f"{PREFIX}-{self.run_id}-{side}"

    @property
    def coordinator_ip(self) -> str:
        return f"{NETS['CR' if self.relay else 'CP']}.1"

    @property
    def target_ip(self) -> str:
        """Where participants connect: the coordinator, or the relay's face on their side."""
        return f"{NETS['RP']}.1" if self.relay else f"{NETS['CP']}.1"

    @property
    def participant_ip(self) -> str:
        return f"{NETS['RP' if self.relay else 'CP']}.2"

    def dev(self, side: str) -> str:
        """The veth of `side` facing the other end (C or P); R's faces are rc and rp."""
        return {"C": f"{PREFIX}c{self.run_id}", "P": f"{PREFIX}p{self.run_id}",
                "rc": f"{PREFIX}rc{self.run_id}", "rp": f"{PREFIX}rp{self.run_id}"}[side]

    def up(self) -> None:
        sides = ["C", "P"] + (["R"] if self.relay else [])
        for s in sides:
            sh("ip", "netns", "add", self.ns(s))
            sh("ip", "-n", self.ns(s), "link", "set", "lo", "up")
        if self.relay:
            self._pair("C", self.dev("C"), "R", self.dev("rc"), NETS["CR"], "1", "2")
            self._pair("R", self.dev("rp"), "P", self.dev("P"), NETS["RP"], "1", "2")
        else:
            self._pair("C", self.dev("C"), "P", self.dev("P"), NETS["CP"], "1", "2")
        burst = self.burst or tbf_burst(self.rate_bit)
        for s in ("C", "P"):  # one shaper per direction, at each end's egress
            sh("ip", "netns", "exec", self.ns(s), "tc", "qdisc", "add", "dev", self.dev(s), "root", "tbf",
               "rate", f"{int(self.rate_bit)}bit", "burst", str(burst), "latency", "50ms")
        for s in ("C", "P"):  # a process that lives in the namespace: its /proc/PID/net/dev is the counter
            self.holders[s] = subprocess.Popen(["ip", "netns", "exec", self.ns(s), "sleep", "86400"])

    def _pair(self, a: str, dev_a: str, b: str, dev_b: str, net: str, ha: str, hb: str) -> None:
        sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for side, dev, host in ((a, dev_a, ha), (b, dev_b, hb)):
            sh("ip", "link", "set", dev, "netns", self.ns(side))
            sh("ip", "-n", self.ns(side), "addr", "add", f"{net}.{host}/24", "dev", dev)
            sh("ip", "-n", self.ns(side), "link", "set", dev, "up")

    def down(self) -> None:
        for p in self.holders.values():
            p.kill()
            p.wait()
        self.holders.clear()
        for s in ("C", "P", "R"):
            _delete_ns(self.ns(s))

    def exec_argv(self, side: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(side), *argv]

    # -- counters ------------------------------------------------------------------------------------

    def counters(self) -> tuple[int, int]:
        """(bytes received, bytes sent) by the coordinator side's veth: upload and download on the wire."""
        text = Path(f"/proc/{self.holders['C'].pid}/net/dev").read_text()
        for line in text.splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == self.dev("C"):
                f = rest.split()
                return int(f[0]), int(f[8])
        raise RuntimeError(f"no counters for {self.dev('C')}")

    # -- faults --------------------------------------------------------------------------------------

    def reset(self, upload: bool, port: int) -> str:
        """Abort the connection that carries the transfer (the one with most bytes queued to send:
        the participant's for an upload, the coordinator's for a download) at both ends."""
        side, peer = ("P", "C") if upload else ("C", "P")
        out = sh("ip", "netns", "exec", self.ns(side), "ss", "-tnH", "state", "established").stdout
        best: tuple[int, str, str] | None = None
        for line in out.splitlines():
            f = line.split()  # Recv-Q Send-Q Local Peer
            if len(f) < 4 or not f[3 if upload else 2].endswith(f":{port}"):
                continue
            if best is None or int(f[1]) > best[0]:
                best = (int(f[1]), f[2], f[3])
        if best is None:
            return "no connection to reset"
        _, local, remote = best
        lport, rport = local.rsplit(":", 1)[1], remote.rsplit(":", 1)[1]
        for ns, a, b in ((self.ns(side), lport, rport), (self.ns(peer), rport, lport)):
            sh("ip", "netns", "exec", ns, "ss", "-K", "-tn", f"( sport = :{a} and dport = :{b} )", check=False)
        return f"reset {local} -> {remote} (send queue {best[0]} B)"

    def silence(self, seconds: float, local: bool = False) -> None:
        """Drop every packet arriving at either end for `seconds` (blocks that long). `local`: the
        participant's own sends are refused too (OUTPUT DROP: a send fails at once with EPERM, as
        when its own interface or firewall cuts it off), not only lost in the network."""
        rules = [(self.ns(s), "INPUT", "-i", self.dev(s)) for s in ("C", "P")]
        if local:
            rules.append((self.ns("P"), "OUTPUT", "-o", self.dev("P")))
        for ns, chain, flag, dev in rules:
            sh("ip", "netns", "exec", ns, "iptables", "-I", chain, flag, dev, "-j", "DROP")
        try:
            time.sleep(seconds)
        finally:
            for ns, chain, flag, dev in rules:
                sh("ip", "netns", "exec", ns, "iptables", "-D", chain, flag, dev, "-j", "DROP", check=False)


class Sampler:
    """Samples the coordinator's veth counters every `interval_s` on a thread: (t, rx, tx)."""

    def __init__(self, link: Link, interval_s: float = 0.01) -> None:
        self.link = link
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rx, tx = self.link.counters()
            with self._lock:
                self.samples.append((time.time(), rx, tx))
            self._stop.wait(self.interval_s)

    def latest(self) -> tuple[float, int, int]:
        with self._lock:
            return self.samples[-1] if self.samples else (time.time(), *self.link.counters())

    def window(self, t0: float, t1: float) -> list[tuple[float, int, int]]:
        with self._lock:
            return [s for s in self.samples if t0 <= s[0] <= t1]


def busy_span(samples: list[tuple[float, int, int]], index: int, rate_bit: float,
              share: float = 0.05) -> tuple[float, float] | None:
    """(start, end) from the first to the last sample interval in which direction `index` (1: rx,
    2: tx) moved more than `share` of what the link could carry: when a transfer ran."""
    active = [(a[0], b[0]) for a, b in itertools.pairwise(samples)
              if b[index] - a[index] > share * rate_bit / 8 * (b[0] - a[0])]
    return (active[0][0], active[-1][1]) if active else None


def busy_seconds(samples: list[tuple[float, int, int]], index: int, rate_bit: float, share: float = 0.05) -> float:
    span = busy_span(samples, index, rate_bit, share)
    return span[1] - span[0] if span else 0.0


def parse_rate(text: str) -> float:
    """'100M', '1G', '400mbit', '1e9' -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmg]?)(?:bit|b|bps)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (e.g. 100M, 1G)")
    value = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    if not 1e6 <= value <= 1e11:
        raise ValueError(f"rate {text!r} out of range (1 Mbit/s to 100 Gbit/s)")
    return value
