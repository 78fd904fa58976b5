"""Round time and bytes per parameter with and without secure aggregation, through a real
coordinator on loopback.

    python benchmarks/secagg_round.py                          # 100M parameters, N = 4 and 8
    python benchmarks/secagg_round.py --params 10e6 --n 4      # a quick look
    python benchmarks/secagg_round.py --params 4e6 --n 4 --modes secagg ahead   # masks drawn ahead or not

N participant engines (`SyncEngine`, the participant's own code) in threads of this process, the
coordinator in-process (`BackgroundCoordinator`), one model of --params float32 parameters in 4
tensors, FedAvg. Each round every participant moves its weights by a fixed random Δ, "trains"
for --train-s seconds (a sleep: the inner steps), then all sync at once (`SyncEngine.fetch`:
upload, merge, download). The modes side by side, same run:

  int8     plain rounds with `train.compression: int8` (block scales, ~1.02 bytes a parameter)
  secagg   secure aggregation (keys, shares, masked 2^16-ring upload, reveal, unmask), dp off,
           every step after the inner steps
  ahead    the same, with keys, shares and the masks drawn during the inner steps
           (`secagg_sync.start_ahead` at the round's start, as the participant does): after them
           only the claim, the encoding, one ring addition per tensor, the upload and the reveal

Round time: from the moment every participant starts its sync until the last one holds the
new model (the --train-s before it is not counted, whatever ran in it). To upload: from that
moment until a participant's upload starts (what it does after its inner steps before its update
is on the wire: the protocol's phases and the masking), the median over participants and rounds. Bytes per
parameter: the round's bytes in (as the coordinator counted them) / (N × parameters). The first
round of each mode is a warm-up; the best and the median of --rounds others are printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.engine.secagg_sync import start_ahead
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.wire import write_file

TOKEN = "participant-token"  # BackgroundCoordinator's default participant token


def config(mode: str, n: int, rounds: int) -> RunConfig:
    data: dict[str, Any] = {
        "name": "bench", "rounds": rounds, "min_participants": n, "round_timeout_s": 3600,
        "heartbeat_interval_s": 30, "heartbeat_timeout_s": 3600, "keep_checkpoints": 1, "max_upload_mb": 100_000,
        "outer": {"algorithm": "fedavg"},
        "train": {"compression": "int8", "error_feedback": False},
    }
    if mode in ("secagg", "ahead"):
        data["privacy"] = {"secure_aggregation": True, "dp": False, "secagg_range": 0.05,
                           "secagg_max_participants": max(n, 2), "secagg_phase_timeout_s": 600}
    return RunConfig.model_validate(data)


class Site(threading.Thread):
    """One participant: joins, downloads, then each round moves by its Δ and syncs."""

    def __init__(self, url: str, pid: str, shapes: dict[str, tuple[int, ...]], cfg: RunConfig, rounds: int,
                 start: threading.Barrier, done: threading.Barrier, ahead: bool, train_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.pid, self.cfg, self.rounds = url, pid, cfg, rounds
        self.ahead, self.train_s = ahead, train_s
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}
        self.seed = sum(map(ord, pid))  # each round's Δ is drawn again from it: no copy of Δ held
        self.start_all, self.done = start, done
        self.error: BaseException | None = None
        self.started = 0.0
        self.to_upload: list[float] = []  # per round: from the sync's start to our upload's start

    def run(self) -> None:
        try:
            with CoordinatorClient(self.url, TOKEN) as cl:
                upload = cl.upload

                def timed(*args: Any, **kwargs: Any) -> Any:
                    self.to_upload.append(time.perf_counter() - self.started)
                    return upload(*args, **kwargs)

                cl.upload = timed  # type: ignore[method-assign]
                joined = cl.join(self.pid)
                engine = SyncEngine(cl, self.params, who=self.pid)
                engine.prepare(joined["model"])
                r = engine.load_global(self.pid)
                for _ in range(self.rounds):
                    if self.ahead:  # the round starts: keys, shares and masks while it trains
                        start_ahead(engine, r, self.pid, self.cfg)
                    g = torch.Generator().manual_seed(self.seed)
                    for p in self.params.values():
                        p.sub_(torch.randn(p.shape, generator=g).mul_(0.003))
                    time.sleep(self.train_s)
                    self.start_all.wait()
                    self.started = time.perf_counter()
                    r = engine.fetch(r, self.pid, self.cfg, tokens=1000)
                    engine.adopt()
                    self.done.wait()
        except BaseException as e:  # reported by the main thread
            self.error = e
            self.start_all.abort()
            self.done.abort()


def measure(mode: str, n: int, params: int, rounds: int, train_s: float) -> dict[str, Any]:
    size = params // 4
    shapes = {f"layer.{i}": (size,) for i in range(4)}
    cfg = config(mode, n, rounds + 1)
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init.safetensors"
        write_file(init, {k: torch.zeros(s) for k, s in shapes.items()})
        with BackgroundCoordinator(Path(tmp) / "state", cfg, init_weights=init) as c:
            start, done = threading.Barrier(n + 1), threading.Barrier(n + 1)
            sites = [Site(c.url, f"p{i}", shapes, cfg, rounds + 1, start, done, mode == "ahead", train_s)
                     for i in range(n)]
            for s in sites:
                s.start()
            times = []
            for _ in range(rounds + 1):
                start.wait(timeout=3600)
                t0 = time.perf_counter()
                done.wait(timeout=3600)
                times.append(time.perf_counter() - t0)
            for s in sites:
                s.join(60)
                if s.error is not None:
                    raise s.error
            history = c.service.round_history(rounds + 1)
    per_param = [h["bytes_in"] / (n * 4 * size) for h in history]
    measured = times[1:]
    to_upload = [t for s in sites for t in s.to_upload[1:]]
    return {"mode": mode, "n": n, "best_s": min(measured), "median_s": statistics.median(measured),
            "bytes_per_param": statistics.median(per_param), "to_upload_s": statistics.median(to_upload)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per mode (after one warm-up)")
    ap.add_argument("--modes", nargs="+", choices=["int8", "secagg", "ahead"], default=["int8", "secagg", "ahead"])
    ap.add_argument("--train-s", type=float, default=2.0, help="the inner steps' time (a sleep, not counted)")
    args = ap.parse_args()
    print(f"{'N':>3} {'mode':>7} {'best s':>8} {'median s':>9} {'bytes/param':>12} {'vs first':>8} "
          f"{'to upload s':>12}")
    for n in args.n:
        rows = [measure(m, n, int(args.params), args.rounds, args.train_s) for m in args.modes]
        for row in rows:
            ratio = row["median_s"] / rows[0]["median_s"]
            print(f"{n:>3} {row['mode']:>7} {row['best_s']:>8.2f} {row['median_s']:>9.2f} "
                  f"{row['bytes_per_param']:>12.3f} {ratio:>7.2f}x {row['to_upload_s']:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
