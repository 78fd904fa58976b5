"""Transfers on a shaped link (issue #34): how much of the link a sync uses, and what a broken or
silent link costs, with a real coordinator and real participants in two network namespaces.

    sudo python benchmarks/links.py --quick                   # a few minutes: 100 MB, N = 1, two rates
    sudo python benchmarks/links.py --json links.json         # the full table (tens of minutes)
    sudo python benchmarks/links.py --baseline-src /path/to/other/checkout/src --label merged

Coordinator and participants run in two namespaces joined by a veth pair, `tc tbf` at the rate on
both directions (link_net.py); every process runs with PYTHONPATH at the checkout under test, so
`--baseline-src` puts another checkout's figures beside this one's, each cell run for both in turn.
Figures (link_runs.py): the fraction of the link a sync uses ((upload + download bytes) / (round
time x rate), the round from the first participant's upload to the last one's download), and the
upload and download on their own (wire bytes / the time bytes moved); a reset at 50% of an upload
and of a download, a link silent for 2 s and 60 s from 50% of an upload: bytes sent again per
update, extra round time, and `fed.history`'s sync time beside the round's real time. With
`--relay-rtt-ms`, raw TCP through a relay that adds latency (link_relay.py: what it emulates and
what not), 1 stream against several, and syncs through it with `--streams` (`transfer.streams`).

Without root or `ip netns` it says so and exits 0 (skipped). Namespaces are named fdlk-*; the
leftovers of a crashed run are removed at the start, and each run's own at its end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from link_net import Link, check_support, cleanup_leftovers, parse_rate
from link_runs import DEFAULT_FAULTS, FAULTS, Side, raw_tcp, run_sync, summarize_clean, summarize_fault
from link_tables import fault_table, relay_table, sync_table

REPO_SRC = Path(__file__).resolve().parents[1] / "src"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="100 MB model, N = 1, 100 Mbit/s and 1 Gbit/s, one measured round, reset-up and silent-2")
    p.add_argument("--label", default="this", help="name of this checkout's column (default: this)")
    p.add_argument("--src", type=Path, default=REPO_SRC, help="the src/ of the checkout measured (default: this one)")
    p.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src/, measured beside it")
    p.add_argument("--baseline-label", default="baseline")
    p.add_argument("--models", type=_floats, default=None, help="model sizes in M fp32 parameters (default 25,100)")
    p.add_argument("--rates", type=_rates, default=None, help="link rates (default 100M,1G)")
    p.add_argument("--participants", type=_ints, default=None, help="N (default 1,4)")
    p.add_argument("--warmup", type=int, default=1, help="rounds not measured (default 1)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 2; --quick 1)")
    p.add_argument("--tensors", type=int, default=8, help="tensors the model is split into (default 8)")
    p.add_argument("--faults", type=_faults, default=None,
                   help=f"faults to inject, of {','.join(FAULTS)} (default all but down-2; --quick reset-up,silent-2; "
                        "none: '')")
    p.add_argument("--fault-rate", type=parse_rate, default=parse_rate("1G"), help="link rate of the fault runs (1G)")
    p.add_argument("--fault-model", type=float, default=25.0, help="model of the fault runs, M parameters (25)")
    p.add_argument("--relay-rtt-ms", type=_floats, default=None,
                   help="round-trip times added by the relay, e.g. 50 (default none: no relay runs)")
    p.add_argument("--relay-rate", type=parse_rate, default=parse_rate("1G"))
    p.add_argument("--relay-window", type=int, default=None,
                   help="bytes one connection may have in flight over the relay's RTT (default: tcp_wmem max)")
    p.add_argument("--relay-streams", type=_ints, default=[1, 4], help="raw TCP streams through the relay (1,4)")
    p.add_argument("--streams", type=_ints, default=None,
                   help="transfer.streams of syncs through the relay (e.g. 1,2,4; needs a checkout that has it)")
    p.add_argument("--part-mb", type=int, default=None,
                   help="transfer.part_mb of every run (default: the checkout's own; needs a checkout that has it)")
    p.add_argument("--tbf-burst", type=int, default=None,
                   help="tbf's bucket in bytes (default: 2 ms at the rate, at least 64 KiB)")
    p.add_argument("--cpu-hogs", type=int, default=0,
                   help="busy processes to run beside the runs (CPU contention on purpose; default 0)")
    p.add_argument("--limit-s", type=float, default=900.0, help="longest one run may take before it is cut (900)")
    p.add_argument("--parts", type=_parts, default=["sync", "faults", "relay"],
                   help="which parts to run, of sync,faults,relay (default all; relay needs --relay-rtt-ms)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="print the tables of an earlier run's --json; run nothing")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--dir", type=Path, default=None, help="runs' state and logs here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    quick = args.quick
    args.models = args.models or ([25.0] if quick else [25.0, 100.0])
    args.rates = args.rates or [parse_rate("100M"), parse_rate("1G")]
    args.participants = args.participants or ([1] if quick else [1, 4])
    if args.rounds is None:
        args.rounds = 1 if quick else 2
    if args.faults is None:
        args.faults = ["reset-up", "silent-2"] if quick else list(DEFAULT_FAULTS)
    if args.warmup < 1 or args.rounds < 1:
        p.error("--warmup and --rounds must be at least 1")
    return args


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(not 1 <= v <= 64 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers from 1 to 64, comma-separated: {text!r}")
    return values


def _floats(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or any(not 0 < v <= 10_000 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, comma-separated: {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        return [parse_rate(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parts(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ("sync", "faults", "relay")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"parts are sync, faults, relay: {text!r}")
    return names


def _faults(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in FAULTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown fault {bad[0]!r}: one of {', '.join(FAULTS)}")
    return names


@contextmanager
def shaped(rate_bit: float, relay: bool = False, burst: int | None = None) -> Iterator[Link]:
    link = Link(rate_bit, relay=relay, burst=burst)
    try:
        link.up()
        yield link
    finally:
        link.down()


class Bench:
    """Runs the cells and keeps every figure (`self.report`, the JSON written at the end)."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.sides = [Side(args.label, args.src)]
        if args.baseline_src is not None:
            self.sides.append(Side(args.baseline_label, args.baseline_src))
        self.port = 18000
        self.serial = itertools.count()  # each run's own directory
        self.inits: dict[int, Path] = {}
        self.report: dict[str, Any] = {"sides": [s.label for s in self.sides], "args": _jsonable(vars(args)),
                                       "raw": [], "sync": [], "faults": [], "relay": []}

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def init(self, params: int) -> Path:
        """The initial model file of that size (written once, with the first side's torch)."""
        if params not in self.inits:
            path = self.tmp / f"init-{params}.safetensors"
            code = ("import sys, torch; from fedtrain.wire import write_file;"
                    "p, k = int(sys.argv[1]), int(sys.argv[2]);"
                    "g = torch.Generator().manual_seed(0);"
                    "write_file(sys.argv[3], {f'w.{i}': torch.randn(p // k, generator=g) * 0.02 for i in range(k)})")
            subprocess.run([sys.executable, "-c", code, str(params), str(self.args.tensors), str(path)], check=True,
                           env={"PYTHONPATH": str(self.sides[0].src), "PATH": "/usr/bin:/bin"})
            self.inits[params] = path
        return self.inits[params]

    def sync_cells(self) -> None:
        a = self.args
        for rate in a.rates:
            with shaped(rate, burst=a.tbf_burst) as link:
                raw = raw_tcp(link, 1, int(min(4e8, rate / 8 * 4)), self.next_port())
                self.report["raw"].append({"rate_bit": rate, **raw})
                _say(f"raw TCP at {_rate(rate)}: {raw['fraction']:.3f} of the link, CPU s/GB: sink "
                     f"{raw['sink_cpu_per_gb']:.2f}, source {raw['source_cpu_per_gb']:.2f}")
                for m in a.models:
                    params = int(m * 1e6)
                    for n in a.participants:
                        for side in self.sides:
                            self.one(link, side, params, n, a.warmup, a.rounds, None, self.report["sync"])

    def one(self, link: Link, side: Side, params: int, n: int, warmup: int, rounds: int, fault: str | None,
            into: list[dict[str, Any]], transfer: dict[str, Any] | None = None,
            port: int | None = None) -> dict[str, Any]:
        if self.args.part_mb is not None:
            transfer = {**(transfer or {}), "part_mb": self.args.part_mb}
        streams = (transfer or {}).get("streams", 1)
        name = f"run-{next(self.serial)}-{side.label}-{params}-{n}-{fault}-{int(link.rate_bit)}-p{streams}"
        run_dir = self.tmp / name
        t0 = time.monotonic()
        result = run_sync(link, side, self.init(params), params, self.args.tensors, n, warmup, rounds,
                          port or self.next_port(), run_dir, fault=fault, transfer=transfer, limit_s=self.args.limit_s)
        result["measured"] = rounds
        result["transfer"] = transfer
        result["summary"] = summarize_fault(result, warmup) if fault else summarize_clean(result)
        into.append(result)
        _say(f"{side.label}: {params / 1e6:g}M params, {_rate(link.rate_bit)}, N={n}, fault={fault}: "
             f"{json.dumps(_rounded(result['summary']))} ({time.monotonic() - t0:.0f} s)"
             + (f" ERROR {result['error']}" if "error" in result else ""))
        return result

    def fault_cells(self) -> None:
        a = self.args
        if not a.faults:
            return
        with shaped(a.fault_rate, burst=a.tbf_burst) as link:
            for fault in a.faults:
                for side in self.sides:  # round 0 warms up, round 1 takes the fault, round 2 is clean
                    self.one(link, side, int(a.fault_model * 1e6), 1, 1, 2, fault, self.report["faults"])

    def relay_cells(self) -> None:
        from link_relay import Relay, default_window

        a = self.args
        for rtt in a.relay_rtt_ms or []:
            window = a.relay_window or default_window()
            with shaped(a.relay_rate, relay=True, burst=a.tbf_burst) as link:
                for streams in a.relay_streams:
                    port = self.next_port()
                    with Relay(link, port, rtt, window):
                        raw = raw_tcp(link, streams, int(min(4e8, a.relay_rate / 8 * 4)), port)
                    self.report["relay"].append({"rtt_ms": rtt, "window": window, "kind": "raw", **raw})
                    _say(f"relay {rtt:g} ms, {streams} raw TCP stream(s): {raw['fraction']:.3f} of the link")
                for streams in a.streams or []:
                    for side in self.sides:
                        port = self.next_port()
                        with Relay(link, port, rtt, window):
                            r = self.one(link, side, int(a.models[0] * 1e6), 1, a.warmup, a.rounds, None,
                                         self.report["relay"], transfer={"streams": streams}, port=port)
                        r.update(rtt_ms=rtt, window=window, kind="sync", streams=streams)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}


def _rate(bit: float) -> str:
    return f"{bit / 1e9:g} Gbit/s" if bit >= 1e9 else f"{bit / 1e6:g} Mbit/s"


def _say(text: str) -> None:
    print(text, flush=True)


def load() -> str:
    """The load average (1, 5, 15 min): the machine is shared, and 1 Gbit/s figures feel it."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def print_tables(report: dict[str, Any]) -> None:
    print(f"load average before / after: {report['load_before']} / {report['load_after']}")
    for text in (sync_table(report), fault_table(report), relay_table(report)):
        if text:
            print(text)
            print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        print_tables(json.loads(args.from_json.read_text()))
        return 0
    why = check_support()
    if why is not None:
        print(f"links: skipped: {why}")
        return 0
    left = cleanup_leftovers()
    if left:
        _say(f"removed namespaces left by an earlier run: {', '.join(left)}")
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="links-"))
    tmp.mkdir(parents=True, exist_ok=True)
    failed = True
    try:
        bench = Bench(args, tmp)
        bench.report["load_before"] = load()
        t0 = time.monotonic()
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.cpu_hogs)]
        try:
            for part in args.parts:
                {"sync": bench.sync_cells, "faults": bench.fault_cells, "relay": bench.relay_cells}[part]()
        finally:
            for h in hogs:
                h.kill()
                h.wait()
            bench.report["load_after"] = load()
            bench.report["seconds"] = time.monotonic() - t0
            if args.json:
                args.json.write_text(json.dumps(bench.report, indent=1))
        failed = any("error" in r for k in ("sync", "faults", "relay") for r in bench.report[k])
        print()
        print_tables(bench.report)
    finally:
        if failed or args.dir:
            print(f"runs' state and logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
