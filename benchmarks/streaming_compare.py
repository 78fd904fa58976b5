"""Streaming DiLoCo numerics: torchft 0.2.0 against `fedtrain.streaming.simulate`, same problem.

    python benchmarks/torchft_compare.py --setup      # once: torchft 0.2.0 in .benchmarks/torchft-venv
    python benchmarks/streaming_compare.py            # the table of docs/streaming.md (about a minute)
    python benchmarks/streaming_compare.py --quick    # three rows
    python benchmarks/streaming_compare.py --diagram  # the schedule of one H, printed, nothing run

A small seeded problem: `Net` (streaming_net.py), an input layer, 4 residual tanh blocks (`blocks.<i>.`) and a
head, width 20 (1,802 parameters); each replica trains on its own seeded stream of regression batches.
torchft runs it for real, from its own venv: an in-process `LighthouseServer` (min_replicas
= M), and M replica groups of world size 1 in threads of one process (as torchft's own
integration tests run them), each with its own TCPStore, `ProcessGroupGloo` on loopback and
`Manager(use_async_quorum=False, init_sync=False)`, training under `DiLoCo(manager,
fragment_modules, inner, [one outer SGD(lr=0.7, momentum=0.9, nesterov=True) per fragment],
sync_every=H, fragment_sync_delay=τ, fragment_update_alpha=α)`. The fragments are
`fedtrain.streaming.fragments` of the model's names (strided unless a row says otherwise),
handed to torchft as modules holding those parameters.
`simulate` runs the same replicas, data, inner and outer optimizers in this process. Compared,
as the largest absolute difference: every replica's final local weights, and every
fragment's global weights (torchft's `original_parameters` on each replica against the
simulator's θ_g). For K = 1, τ = 0, α = 0 a column also compares plain DiLoCo as
fedtrain's merge computes it (`RunningSum` of the Δs, `OuterOptimizer` "diloco") with torchft.
The last column runs every row through fedtrain itself (`fedtrain_run`: a coordinator and M
participants over loopback) and compares its global weights with torchft's.
One torch intra-op thread on both sides, so that reductions add up in one order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from streaming_net import Net, mse  # beside this file: also found when torchft's venv runs it as the worker
from torch import nn

HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
#: torchft_compare.py --setup makes it here; TORCHFT_VENV or --venv point elsewhere (another checkout's).
VENV = Path(os.environ.get("TORCHFT_VENV") or BENCH_DIR.parent / ".benchmarks" / "torchft-venv")
TOLERANCE = 1e-5


# ---------------------------------------------------------------- the problem (both venvs)


def build() -> Net:
    """The same weights every time (torchft's init_sync=False assumes identical replicas), drawn
    from a generator of its own: torchft's replicas are threads, and the global RNG is shared."""
    model = Net()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.1))
    return model


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 3, generator=g) + 0.5 * replica  # each replica its own data
    return x, torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)


def inner_optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def as_lists(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {k: v.detach().tolist() for k, v in tensors.items()}  # float32 -> float is exact


# ---------------------------------------------------------------- torchft side (its venv)


class Fragment(nn.Module):
    """A torchft model fragment: the model's own parameters (shared, not copied), by name."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        params = dict(model.named_parameters())
        self.names = names
        for i, name in enumerate(names):
            self.register_parameter(f"p{i}", params[name])


def torchft_replica(cfg: dict[str, Any], replica: int, lighthouse: str) -> dict[str, Any]:
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    model = build()
    frags = [Fragment(model, names) for names in cfg["fragments"]]
    inner = inner_optimizer(cfg["inner"], list(model.parameters()))
    outers = [outer_optimizer(list(f.parameters())) for f in frags]
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    op = timedelta(seconds=60)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=op), load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        min_replica_size=cfg["replicas"], use_async_quorum=False, init_sync=False, replica_id=f"replica_{replica}",
        lighthouse_addr=lighthouse, store_addr=HOST, store_port=store.port, rank=0, world_size=1, hostname=HOST,
        timeout=op, quorum_timeout=op, connect_timeout=op, max_retries=0)
    try:
        with DiLoCo(manager, list(frags), inner, outers, sync_every=cfg["h"], fragment_sync_delay=cfg["tau"],
                    fragment_update_alpha=cfg["alpha"]) as diloco:
            for t in range(cfg["steps"]):
                inner.zero_grad()
                mse(model, batch(replica, t)).backward()
                inner.step()  # DiLoCo's post-hook sends and applies fragments
            if manager.errored():
                raise RuntimeError(f"torchft manager errored: {manager.errored()}")
            glob = {name: diloco._fragments[p].original_parameters[f"p{i}"]
                    for p, f in enumerate(frags) for i, name in enumerate(f.names)}
        return {"local": as_lists(dict(model.named_parameters())), "global": as_lists(glob),
                "commits": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def torchft_worker(spec_path: Path, out_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from torchft._torchft import LighthouseServer

    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    results = []
    for cfg in spec["configs"]:
        t0 = time.perf_counter()
        lighthouse = LighthouseServer(bind=f"{HOST}:0", min_replicas=cfg["replicas"], join_timeout_ms=1000)
        try:
            with ThreadPoolExecutor(max_workers=cfg["replicas"]) as pool:
                futures = [pool.submit(torchft_replica, cfg, r, lighthouse.address()) for r in range(cfg["replicas"])]
                replicas = [f.result(timeout=spec["timeout"]) for f in futures]
        finally:
            lighthouse.shutdown()
        results.append({"replicas": replicas, "seconds": time.perf_counter() - t0})
        print(f"torchft: {cfg['label']} done in {results[-1]['seconds']:.1f} s", flush=True)
    out_path.write_text(json.dumps({"results": results}))


# ---------------------------------------------------------------- orchestration (fedtrain's venv)


def configs(quick: bool) -> list[dict[str, Any]]:
    """(K, τ, α, inner, M, strategy) rows; H = 12 (so that K = 4 allows τ up to 2), 2H + 1 steps:
    the last step sends a fragment that never arrives (dropped, as torchft drops it) when τ > 0."""
    rows = [(1, 0, 0.0, "adamw", 2, "strided"), (2, 1, 0.5, "adamw", 2, "strided"),
            (4, 2, 0.5, "adamw", 2, "strided")]
    if not quick:
        rows += [(1, 2, 0.0, "adamw", 2, "strided"), (1, 2, 0.5, "adamw", 2, "strided"),
                 (2, 0, 0.0, "adamw", 2, "strided"), (2, 2, 0.0, "adamw", 2, "strided"),
                 (4, 0, 0.5, "adamw", 2, "strided"), (4, 1, 0.0, "adamw", 2, "strided"),
                 (2, 1, 0.5, "sgd", 2, "strided"), (4, 1, 0.5, "adamw", 2, "sequential"),
                 (2, 1, 0.5, "adamw", 3, "strided")]
    from fedtrain.streaming import fragments

    names = [n for n, _ in build().named_parameters()]
    out = []
    for k, tau, alpha, inner, m, strategy in rows:
        h = 12
        out.append({"label": f"K={k} tau={tau} alpha={alpha} {inner} M={m} {strategy}", "k": k, "tau": tau,
                    "alpha": alpha, "inner": inner, "replicas": m, "strategy": strategy, "h": h, "steps": 2 * h + 1,
                    "fragments": fragments(names, k, strategy)})
    return out


def check_venv(venv: Path) -> str:
    python = venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"torchft venv missing at {venv}; create it with: python benchmarks/torchft_compare.py --setup "
                 "(or give --venv)")
    probe = subprocess.run([str(python), "-c", "import torch, torchft.local_sgd; from importlib.metadata import "
                            "version; print(version('torchft'), torch.__version__)"],
                           capture_output=True, text=True, timeout=300, cwd="/")
    if probe.returncode != 0:
        sys.exit(f"torchft does not import in {venv} (rerun torchft_compare.py --setup):\n{probe.stderr[-2000:]}")
    return probe.stdout.strip().splitlines()[-1]


def run_torchft(venv: Path, cfgs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        spec, out = tmp / "spec.json", tmp / "out.json"
        spec.write_text(json.dumps({"configs": cfgs, "timeout": timeout}))
        # torchft's venv has no fedtrain, and its own torch: nothing of this venv's path goes along
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PYTHONWARNINGS"] = "ignore"
        done = subprocess.run([str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--worker", str(spec),
                               str(out)], capture_output=True, text=True, timeout=timeout * len(cfgs) + 60,
                              cwd="/", env=env)
        if done.returncode != 0 or not out.exists():
            sys.exit(f"torchft worker failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        return json.loads(out.read_text())["results"]


def fedtrain_plain_diloco(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Plain DiLoCo through fedtrain's merge: Δᵢ = θ_r − θᵢ into a RunningSum (equal tokens),
    the coordinator's `OuterOptimizer` "diloco" step; the global weights after the last round."""
    from fedtrain.config import OuterConfig, RunConfig, outer_defaults
    from fedtrain.merge import OuterOptimizer, RunningSum, pseudo_gradient

    models = [build() for _ in range(cfg["replicas"])]
    inners = [inner_optimizer(cfg["inner"], list(m.parameters())) for m in models]
    hp = outer_defaults(RunConfig(outer=OuterConfig(lr=0.7)))  # torchft's lr, pinned
    outer = OuterOptimizer(dict(models[0].named_parameters()), "diloco", hp)
    for t in range(cfg["steps"]):
        for r, m in enumerate(models):
            inners[r].zero_grad()
            mse(m, batch(r, t)).backward()
            inners[r].step()
        if (t + 1) % cfg["h"] == 0:
            acc = RunningSum(outer.params)
            for m in models:
                acc.add(pseudo_gradient(outer.params, dict(m.named_parameters())), weight=1)
            outer.step(*acc.scaled())
            with torch.no_grad():
                for m in models:
                    for name, p in m.named_parameters():
                        p.copy_(outer.params[name])
    return outer.params


def fedtrain_run(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The row run by fedtrain itself: a coordinator (streaming config: the row's fragments as
    name lists, τ, α; rounds waiting for all M) and M `Participant`s in threads over loopback,
    each training the replica's model on the replica's batches. Returns the global weights
    once the run has finished: every sync applied in the row's steps (the fragment the last
    step sends, if any, never arrives, as in torchft)."""
    import threading

    from fedtrain.config import RunConfig
    from fedtrain.coordinator import BackgroundCoordinator
    from fedtrain.participant import CoordinatorClient, Participant
    from fedtrain.wire import write_file

    s = cfg["h"] // cfg["k"]
    run = RunConfig.model_validate({
        "name": "streaming-compare", "rounds": cfg["steps"] // s, "min_participants": cfg["replicas"],
        "train": {"sync_every": cfg["h"]}, "outer": {"lr": 0.7},
        "streaming": {"fragments": cfg["k"], "assign": cfg["fragments"], "overlap": cfg["tau"], "alpha": cfg["alpha"]},
    })
    token = "streaming-compare"
    errors: list[BaseException] = []

    def replica(url: str, r: int) -> None:
        try:
            model = build()
            inner = inner_optimizer(cfg["inner"], list(model.parameters()))
            with Participant(url, token=token, model=model, inner_optimizer=inner, name=f"replica{r}") as fed:
                for t in range(cfg["steps"]):
                    if fed.finished:
                        break
                    inner.zero_grad()
                    mse(model, batch(r, t)).backward()
                    inner.step()
                    fed.step(tokens=8)
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        write_file(tmp / "init.safetensors", {n: p.detach() for n, p in build().named_parameters()})
        with BackgroundCoordinator(tmp / "state", run, tokens=_tokens(token),
                                   init_weights=tmp / "init.safetensors") as c:
            threads = [threading.Thread(target=replica, args=(c.url, r)) for r in range(cfg["replicas"])]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            if errors or any(t.is_alive() for t in threads):
                raise RuntimeError(f"a fedtrain participant failed: {errors[0] if errors else 'timed out'}")
            with CoordinatorClient(c.url, token) as client:
                version, weights = client.download()
    if version != run.rounds:
        raise RuntimeError(f"the fedtrain run ended at version {version}, not {run.rounds}")
    return weights


def _tokens(token: str) -> Any:
    from fedtrain.coordinator.members.auth import Tokens

    return Tokens(participant=[token], admin=token + "-admin")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, list]) -> float:
    return max((a[k] - torch.tensor(v, dtype=a[k].dtype)).abs().max().item() for k, v in b.items())


def compare(cfg: dict[str, Any], ft: dict[str, Any]) -> dict[str, Any]:
    from fedtrain.streaming import simulate

    sim = simulate(build, batch, mse, lambda ps: inner_optimizer(cfg["inner"], ps), replicas=cfg["replicas"],
                   steps=cfg["steps"], h=cfg["h"], fragment_names=cfg["fragments"], tau=cfg["tau"],
                   alpha=cfg["alpha"], outer=outer_optimizer)
    reps = ft["replicas"]
    row = {"local": max(max_diff(sim.local[r], reps[r]["local"]) for r in range(len(reps))),
           "global": max(max_diff(sim.global_weights, rep["global"]) for rep in reps),
           "applies": sum(1 for e in sim.events if e[1] == "apply"), "commits": [r["commits"] for r in reps],
           "seconds": ft["seconds"], "fedtrain": None,
           "run": max(max_diff(fedtrain_run(cfg), rep["global"]) for rep in reps)}
    if cfg["k"] == 1 and cfg["tau"] == 0 and cfg["alpha"] == 0.0:
        row["fedtrain"] = max(max_diff(fedtrain_plain_diloco(cfg), rep["global"]) for rep in reps)
    return row


def report(version: str, cfgs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> bool:
    n_params = sum(p.numel() for p in build().parameters())
    print(f"\ntorchft/torch {version}; Net: 4 blocks, {n_params} parameters; H = 12, {cfgs[0]['steps']} inner steps; "
          f"outer SGD(0.7, momentum 0.9, Nesterov) per fragment; max |difference| against torchft, "
          f"tolerance {TOLERANCE:g}")
    head = (f"{'K':>2} {'τ':>2} {'α':>4} {'inner':>6} {'M':>2} {'fragments':>10} {'applied':>7} "
            f"{'local weights':>13} {'global weights':>14} {'fedtrain merge':>14} {'fedtrain run':>12} {'ok':>3}")
    print(head)
    print("-" * len(head))
    ok_all = True
    for cfg, row in zip(cfgs, rows, strict=True):
        fed = "-" if row["fedtrain"] is None else f"{row['fedtrain']:.1e}"
        worst = max(row["local"], row["global"], row["fedtrain"] or 0.0, row["run"])
        ok = worst <= TOLERANCE and all(c == row["applies"] for c in row["commits"])
        ok_all &= ok
        print(f"{cfg['k']:>2} {cfg['tau']:>2} {cfg['alpha']:>4} {cfg['inner']:>6} {cfg['replicas']:>2} "
              f"{cfg['strategy']:>10} {row['applies']:>7} {row['local']:>13.1e} {row['global']:>14.1e} {fed:>14} "
              f"{row['run']:>12.1e} {'yes' if ok else 'NO':>3}")
    print("\napplied: syncs applied (torchft committed as many on every replica). local weights: largest difference "
          "of any replica's final weights; global weights: of every fragment's θ_g (torchft's original_parameters);\n"
          "fedtrain run: the global weights of a real fedtrain coordinator and M participants over loopback.")
    return ok_all


def diagram(h: int, k: int, tau: int, steps: int) -> str:
    """One line per fragment: what follows each inner step (`fedtrain.streaming.schedule`)."""
    from fedtrain.streaming import schedule

    lines = [f"H={h}, K={k}, τ={tau}", f"{'step':>12} " + "".join(str(t % 10) for t in range(1, steps + 1))]
    for p in range(k):
        marks, flying = [], False
        for t in range(1, steps + 1):
            ev = schedule(t, h, k, tau)
            if ev.send == p and ev.apply == p:
                marks.append("*")
            elif ev.send == p:
                flying = True
                marks.append("s")
            elif ev.apply == p:
                flying = False
                marks.append("a")
            else:
                marks.append("-" if flying else ".")
        lines.append(f"{'fragment ' + str(p):>12} " + "".join(marks))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three rows instead of twelve")
    p.add_argument("--diagram", action="store_true", help="print the schedule diagrams and stop")
    p.add_argument("--venv", type=Path, default=VENV, help=f"torchft's virtualenv (default {VENV})")
    p.add_argument("--timeout", type=float, default=120, help="seconds per row for torchft")
    p.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        torchft_worker(*args.worker)
        return
    if args.diagram:
        print("s: sent after this inner step, a: applied after it, *: both (τ = 0), -: in flight\n")
        for h, k, tau in ((12, 1, 0), (12, 4, 0), (12, 4, 2)):
            print(diagram(h, k, tau, 2 * h) + "\n")
        return
    torch.set_num_threads(1)
    version = check_venv(args.venv)
    cfgs = configs(args.quick)
    t0 = time.perf_counter()
    results = run_torchft(args.venv, cfgs, args.timeout)
    rows = [compare(cfg, ft) for cfg, ft in zip(cfgs, results, strict=True)]
    ok = report(version, cfgs, rows)
    print(f"{len(cfgs)} rows in {time.perf_counter() - t0:.0f} s (torchft: "
          f"{sum(r['seconds'] for r in rows):.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
