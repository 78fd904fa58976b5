"""One run of benchmarks/links.py on a shaped link: a real `fedtrain coordinator` in the
coordinator's namespace, N participant processes (link_worker.py) in the other, a fault injected
at a chosen point of one round, and what the round cost (from the participants' `fed.history`,
their own clocks, and the bytes counted on the veth). Also the raw TCP reference of a link.

Every process runs with PYTHONPATH set to the checkout under test (`Side.src`), so the same run
measures any two trees side by side. A fault is injected in the first measured round, once
participant p0 has begun it: `reset-up` / `reset-down` abort the transfer's connection when half of
the model has crossed the link in that direction, `silent-S` drops every packet for S seconds from
the same point of the upload (lost in the network: neither end sees an error), `down-S` also refuses
the participant's own sends for S seconds (each fails at once, as when its interface goes down).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from link_net import Link, Sampler, busy_seconds, busy_span

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "link_worker.py")
TOKEN = "links-bench-token"
FAULTS = ("reset-up", "reset-down", "silent-2", "silent-60", "down-2")
DEFAULT_FAULTS = FAULTS[:4]  # down-2 behaves as silent-2 here: TCP keeps EPERM from the application


@dataclass(frozen=True)
class Side:
    """A checkout under test: its label in the table and its `src` directory."""

    label: str
    src: Path


def env_for(side: Side) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(side.src), "FEDTRAIN_ADMIN_TOKEN": "links-bench-admin"}


def run_config(n: int, rounds: int, transfer: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "links", "rounds": rounds, "min_participants": n, "train": {"sync_every": 1},
        "outer": {"algorithm": "diloco"}, "round_timeout_s": 3600, "heartbeat_interval_s": 5,
        "heartbeat_timeout_s": 3600, "keep_checkpoints": 1, "max_upload_mb": 100_000, "eval": {"every": 1000},
    }
    if transfer:  # only asked for: a checkout without the `transfer` section refuses the key
        cfg["transfer"] = transfer
    return cfg


class Workers:
    """The participant processes: their JSON lines, each stamped with the veth counters as it arrived."""

    def __init__(self, link: Link, side: Side, url: str, n: int, params: int, tensors: int, logdir: Path,
                 coordinator_pid: int) -> None:
        self.coordinator_pid = coordinator_pid
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.procs: list[subprocess.Popen[str]] = []
        self.link = link
        for i in range(n):
            argv = [sys.executable, WORKER, "participant", "--url", url, "--token", TOKEN, "--name", f"p{i}",
                    "--params", str(params), "--tensors", str(tensors)]
            err = open(logdir / f"p{i}.log", "w")
            proc = subprocess.Popen(link.exec_argv("P", argv), stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env_for(side))
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(i, proc), daemon=True).start()

    def _read(self, i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            rx, tx = self.link.counters()
            stamp = {"who": i, "rx": rx, "tx": tx, "coord_cpu": cpu_seconds(self.coordinator_pid)}
            with self.cond:
                self.events.append({**event, **stamp})
                self.cond.notify_all()

    def wait_for(self, pred: Any, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                hit = next((e for e in self.events if pred(e)), None)
                left = deadline - time.monotonic()
                if hit is not None or left <= 0 or all(p.poll() is not None for p in self.procs):
                    return hit
                self.cond.wait(min(left, 0.5))

    def finish(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        ok = True
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                ok = False
                p.kill()
                p.wait()
        return ok and all(p.returncode == 0 for p in self.procs)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_coordinator(link: Link, side: Side, run_dir: Path, init: Path, cfg: dict[str, Any],
                      port: int) -> subprocess.Popen[bytes]:
    (run_dir / "run.json").write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "fedtrain", "--log-level", "warning", "coordinator", "--config",
            str(run_dir / "run.json"), "--state-dir", str(run_dir / "state"), "--host", link.coordinator_ip,
            "--port", str(port), "--init-weights", str(init), "--token", TOKEN]
    log = open(run_dir / "coordinator.log", "w")
    proc = subprocess.Popen(link.exec_argv("C", argv), stdout=log, stderr=subprocess.STDOUT, env=env_for(side))
    deadline = time.monotonic() + 180
    while not (run_dir / "state" / "endpoint.json").exists():
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited ({proc.returncode}): see {run_dir / 'coordinator.log'}")
        if time.monotonic() > deadline:
            break  # an older checkout may not write it: the participants wait for it themselves
        time.sleep(0.2)
    return proc


def inject(fault: str, link: Link, sampler: Sampler, workers: Workers, model_bytes: int, port: int,
           round_: int, note: list[str], at: list[float]) -> None:
    """On a thread: wait for p0 to begin `round_`, then for the point of the fault, and inject it;
    `at`: how far the transfer had gone (its share of the model) when the fault took effect."""
    begin = workers.wait_for(lambda e: e["event"] == "begin" and e["round"] == round_ and e["who"] == 0, 3600)
    if begin is None:
        note.append("round never began")
        return
    rx0 = begin["rx"]
    half = model_bytes // 2
    if fault == "reset-down":  # the download starts once the whole upload has crossed
        while sampler.latest()[1] - rx0 < model_bytes:
            time.sleep(0.002)
        tx0 = sampler.latest()[2]
        while sampler.latest()[2] - tx0 < half:
            time.sleep(0.002)
        note.append(link.reset(upload=False, port=port))
        at.append((sampler.latest()[2] - tx0) / model_bytes)
        return
    while sampler.latest()[1] - rx0 < half:
        time.sleep(0.002)
    if fault == "reset-up":
        note.append(link.reset(upload=True, port=port))
        at.append((link.counters()[0] - rx0) / model_bytes)
    else:
        at.append((link.counters()[0] - rx0) / model_bytes)
        seconds = float(fault.split("-")[1])
        note.append(f"{fault.split('-')[0]} for {seconds:g} s")
        link.silence(seconds, local=fault.startswith("down"))


def run_sync(link: Link, side: Side, init: Path, params: int, tensors: int, n: int, warmup: int, rounds: int,
             port: int, run_dir: Path, fault: str | None = None, transfer: dict[str, Any] | None = None,
             limit_s: float = 900.0) -> dict[str, Any]:
    """One run: `warmup` + `rounds` rounds (a fault in the first measured one); per-round figures."""
    run_dir.mkdir(parents=True)
    model_bytes = 4 * (params // tensors) * tensors
    total = warmup + rounds
    coord = start_coordinator(link, side, run_dir, init, run_config(n, total, transfer), port)
    note: list[str] = []
    at: list[float] = []
    try:
        with Sampler(link) as sampler:
            workers = Workers(link, side, f"http://{link.target_ip}:{port}", n, params, tensors, run_dir, coord.pid)
            if fault:
                spec = (fault, link, sampler, workers, model_bytes, port, warmup, note, at)
                threading.Thread(target=inject, args=spec, daemon=True).start()
            ok = workers.finish(limit_s)
            samples = sampler.window(0, time.time())
    finally:
        coord.terminate()
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()
    out = {"side": side.label, "n": n, "params": params, "model_bytes": model_bytes, "rate_bit": link.rate_bit,
           "fault": fault, "fault_at": at[0] if at else None, "ok": ok, "note": note,
           "rounds": per_round(workers.events, samples, link.rate_bit, n)}
    if not ok:
        out["error"] = f"participants did not finish cleanly in {limit_s:.0f} s: see {run_dir}"
    return out


def per_round(events: list[dict[str, Any]], samples: list[tuple[float, int, int]], rate_bit: float,
              n: int) -> list[dict[str, Any]]:
    """Each round's window (first begin to last end over the participants) and what crossed in it."""
    rounds: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] not in ("begin", "end"):
            continue
        r = rounds.setdefault(e["round"], {"begins": [], "ends": []})
        r["begins" if e["event"] == "begin" else "ends"].append(e)
    out = []
    for k in sorted(rounds):
        b, e = rounds[k]["begins"], rounds[k]["ends"]
        if len(e) < n or not b:
            continue
        first, last = min(b, key=lambda x: x["t"]), max(e, key=lambda x: x["t"])
        seconds = last["t"] - first["t"]
        window = [s for s in samples if first["t"] <= s[0] <= last["t"]]
        moved = sum(x["bytes_up"] + x["bytes_down"] for x in e)
        out.append({
            "round": k, "seconds": seconds, "moved": moved,
            "fraction": moved * 8 / (seconds * rate_bit) if seconds > 0 else None,
            "step_s": max(x["step_s"] for x in e), "sync_s": max(x["sync_s"] for x in e),
            "wire_up": last["rx"] - first["rx"], "wire_down": last["tx"] - first["tx"],
            "up_busy_s": busy_seconds(window, 1, rate_bit), "down_busy_s": busy_seconds(window, 2, rate_bit),
            # CPU seconds per GB moved: the coordinator's over the round, the participants' summed
            "coord_cpu_per_gb": (last["coord_cpu"] - first["coord_cpu"]) / (moved / 1e9) if moved else None,
            "part_cpu_per_gb": sum(x["cpu"] for x in e) - sum(x["cpu"] for x in b) if len(b) == len(e) else None,
        })
        up, down = busy_span(window, 1, rate_bit), busy_span(window, 2, rate_bit)
        if up and down and n == 1:  # where the round's time went besides the two transfers
            out[-1].update(lead_s=up[0] - first["t"], between_s=down[0] - up[1], tail_s=last["t"] - down[1])
        if out[-1]["part_cpu_per_gb"] is not None and moved:
            out[-1]["part_cpu_per_gb"] /= moved / 1e9
    return out


def summarize_clean(result: dict[str, Any]) -> dict[str, Any]:
    """Median figures of a run's measured rounds (the warm-up ones left out)."""
    rows = result["rounds"][-result.get("measured", len(result["rounds"])):]
    if not rows:
        return {"fraction": None}
    rate_b = result["rate_bit"] / 8
    up = [r["wire_up"] / (r["up_busy_s"] * rate_b) for r in rows if r["up_busy_s"] > 0]
    down = [r["wire_down"] / (r["down_busy_s"] * rate_b) for r in rows if r["down_busy_s"] > 0]
    return {
        "fraction": statistics.median(r["fraction"] for r in rows),
        "round_s": statistics.median(r["seconds"] for r in rows),
        "sync_s": statistics.median(r["sync_s"] for r in rows),
        "up_wire_fraction": statistics.median(up) if up else None,
        "down_wire_fraction": statistics.median(down) if down else None,
        "coord_cpu_per_gb": _median(r.get("coord_cpu_per_gb") for r in rows),
        "part_cpu_per_gb": _median(r.get("part_cpu_per_gb") for r in rows),
        "between_s": _median(r.get("between_s") for r in rows),
    }


def _median(values: Any) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def summarize_fault(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The fault round against the clean rounds of the same run: bytes sent again (in the
    transfer's direction, on the wire) per update, and the extra seconds."""
    rows = {r["round"]: r for r in result["rounds"]}
    hit = rows.get(warmup)
    clean = [r for k, r in rows.items() if k != warmup and k > 0] or [r for k, r in rows.items() if k != warmup]
    if hit is None or not clean:
        return {"resent": None, "extra_s": None, "round_s": None, "sync_s": None}
    key = "wire_down" if result["fault"] == "reset-down" else "wire_up"
    ref_bytes = statistics.median(r[key] for r in clean)
    ref_s = statistics.median(r["seconds"] for r in clean)
    return {"at": result.get("fault_at"), "resent": (hit[key] - ref_bytes) / result["model_bytes"],
            "extra_s": hit["seconds"] - ref_s,
            "round_s": hit["seconds"], "sync_s": hit["sync_s"], "step_s": hit["step_s"], "clean_round_s": ref_s}


def raw_tcp(link: Link, streams: int, nbytes: int, port: int, through_relay: bool = False) -> dict[str, Any]:
    """One transfer of `nbytes` over `streams` TCP connections, participant side to coordinator side."""
    sink = subprocess.Popen(link.exec_argv("C", [sys.executable, WORKER, "sink", "--port", str(port),
                                                 "--streams", str(streams)]), stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    sink.stdout.readline()  # listening
    host = link.target_ip
    src = subprocess.run(link.exec_argv("P", [sys.executable, WORKER, "source", "--host", host, "--port", str(port),
                                              "--streams", str(streams), "--bytes", str(nbytes)]),
                         capture_output=True, text=True, timeout=600)
    out, _ = sink.communicate(timeout=60)
    if src.returncode != 0:
        raise RuntimeError(f"raw TCP source failed: {src.stderr.strip()[-300:]}")
    got = json.loads(out.strip().splitlines()[-1])
    sent = json.loads(src.stdout.strip().splitlines()[-1])
    return {"streams": streams, "bytes": got["bytes"], "seconds": got["seconds"],
            "fraction": got["bytes"] * 8 / (got["seconds"] * link.rate_bit),
            "sink_cpu_per_gb": got["cpu"] / (got["bytes"] / 1e9),
            "source_cpu_per_gb": sent["cpu"] / (got["bytes"] / 1e9)}
