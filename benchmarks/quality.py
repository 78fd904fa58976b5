"""Learning quality: DiLoCo, FedAvg and FedOpt against synchronous data parallelism, same tokens.

An in-process simulation of a run of M participants: each has its own copy of the built-in
byte-level GPT and its own AdamW inner optimizer (kept across rounds), trains H inner steps
on its own data, and its Δ = θ_r − θᵢ is merged exactly as the coordinator merges it
(`fedtrain.merge`: token-weighted `RunningSum`, then `OuterOptimizer.step`). Uploads are
encoded as the participant encodes them (`fedtrain.wire.compress`, optional error feedback)
and counted in bytes with `EncodedBody.content_length`. The baseline is synchronous data
parallelism with M workers, simulated by accumulating the gradients of M micro-batches (one
from each participant's stream, so every method sees the very same tokens) into one AdamW
step. Every method gets the same inner learning-rate schedule, seeds and token budget, and
the global model is evaluated on the fixed held-out stdlib modules (`heldout_paths()`).

    python benchmarks/quality.py                  # the full study (about an hour on 2 cores)
    python benchmarks/quality.py --quick          # a few minutes: smaller model, fewer steps
    python benchmarks/quality.py --jobs 2 --cache /tmp/quality-cache
    python benchmarks/quality.py --only dp diloco-h100 --cache /tmp/quality-cache

Writes `quality.md` (settings, table, goals; hand-written text outside the generated block is
kept on a rerun) and `quality.png` (held-out loss against tokens) into --out-dir (default
docs/, or a temporary directory with --quick). `--cache DIR` keeps one JSON per finished run,
keyed by its settings, so an interrupted or extended study only runs what is missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import dataclasses
import hashlib
import json
import math
import multiprocessing
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from quality_report import goals, plot, table, write_markdown

from fedtrain.config import ModelConfig, OuterConfig, outer_defaults
from fedtrain.merge import OuterOptimizer, RunningSum, contribution_weights, pseudo_gradient
from fedtrain.recipes import (
    TokenStream,
    build_model,
    count_parameters,
    evaluate,
    heldout_paths,
    load_tokens,
    stdlib_shards,
)
from fedtrain.wire import EncodedBody
from fedtrain.wire.compress import ErrorFeedback, compress, decompress

IID_CHUNK = 4096  # bytes per piece when the pooled corpus is dealt out at random (IID split)


@dataclass(frozen=True)
class Setup:
    """What every method of one study shares: model, data, inner optimizer, budget, evaluation."""

    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    seq_len: int = 64
    batch_size: int = 8  # sequences per inner step of one participant (one DP micro-batch)
    workers: int = 4  # M
    steps: int = 1000  # inner steps per participant (= DP steps); tokens = steps·M·batch·seq_len
    lr: float = 3e-3  # peak inner AdamW learning rate
    warmup_frac: float = 0.05  # linear warm-up of the inner lr, then cosine decay ...
    final_lr_frac: float = 0.1  # ... down to this fraction of the peak
    grad_clip: float = 1.0
    eval_every: int = 50  # inner steps between held-out evaluations (DiLoCo: at the next round end)
    eval_batches: int = 16
    eval_batch_size: int = 32
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.seq_len


FULL = Setup()
QUICK = Setup(n_layer=1, n_embd=64, n_head=2, seq_len=32, steps=200, eval_every=20, eval_batches=8)


@dataclass(frozen=True)
class Method:
    """One row of the table: the baseline, or a federated run with its outer optimizer and options."""

    name: str
    group: str  # main | tuning | investigation
    kind: str = "fed"  # dp | fed | solo (participant 0 alone, a quarter of the tokens)
    algorithm: str = "diloco"
    sync_every: int = 0  # H
    outer_lr: float | None = None  # None: outer_defaults
    split: str = "noniid"  # noniid (stdlib_shards) | iid (pooled and dealt out at random)
    compression: str = "none"  # none | int8
    error_feedback: bool = False
    sync_warmup: int = 0  # first inner steps trained as synchronous DP, then federated from there

    def describe(self) -> str:
        if self.kind == "dp":
            return "synchronous data-parallel (AdamW, grad accumulation over M micro-batches)"
        if self.kind == "solo":
            return "one participant alone on its shard (¼ of the tokens), no communication"
        hp = outer_defaults(OuterConfig(algorithm=self.algorithm, lr=self.outer_lr))  # type: ignore[arg-type]
        parts = [f"{self.algorithm} H={self.sync_every}", f"outer lr {hp['lr']:g}"]
        if self.split == "iid":
            parts.append("IID split")
        if self.compression != "none":
            parts.append(f"{self.compression} Δ" + (" + error feedback" if self.error_feedback else ""))
        if self.sync_warmup:
            parts.append(f"first {self.sync_warmup} steps synchronous")
        return ", ".join(parts)


def methods() -> list[Method]:
    """Every run of the study, most important first."""
    out = [Method("dp", "main", kind="dp")]
    for h in (10, 50, 100):
        out.append(Method(f"diloco-h{h}", "main", sync_every=h))
    for h in (10, 50, 100):
        out.append(Method(f"fedavg-h{h}", "main", algorithm="fedavg", sync_every=h))
    for lr in (0.003, 0.01, 0.03, 0.1):
        out.append(Method(f"fedadam-h50-lr{lr:g}", "tuning", algorithm="fedadam", sync_every=50, outer_lr=lr))
    out += [
        Method("diloco-h50-iid", "main", sync_every=50, split="iid"),
        Method("diloco-h50-int8", "main", sync_every=50, compression="int8"),
        Method("diloco-h50-int8-ef", "main", sync_every=50, compression="int8", error_feedback=True),
        # Where DiLoCo falls short: the outer learning rate at small and large H, and a synchronous start.
        Method("diloco-h10-lr0.1", "investigation", sync_every=10, outer_lr=0.1),
        Method("diloco-h100-lr0.3", "investigation", sync_every=100, outer_lr=0.3),
        Method("diloco-h100-lr1", "investigation", sync_every=100, outer_lr=1.0),
        Method("diloco-h100-warm100", "investigation", sync_every=100, sync_warmup=100),
        Method("solo", "investigation", kind="solo"),
    ]
    return out


# ---- data, schedule, evaluation ----------------------------------------------------------------


def worker_tokens(setup: Setup, split: str) -> list[torch.Tensor]:
    """The training tokens of each participant: its stdlib shard, or a random quarter of all."""
    shards = [load_tokens(paths) for paths in stdlib_shards(setup.workers)]
    if split == "noniid":
        return shards
    pool = torch.cat(shards)
    pieces = pool[: pool.numel() // IID_CHUNK * IID_CHUNK].view(-1, IID_CHUNK)
    order = torch.randperm(pieces.size(0), generator=torch.Generator().manual_seed(setup.seed + 7))
    return [pieces[order[k :: setup.workers]].reshape(-1) for k in range(setup.workers)]


def worker_streams(setup: Setup, split: str) -> list[TokenStream]:
    return [
        TokenStream(t, batch_size=setup.batch_size, seq_len=setup.seq_len, seed=setup.seed + 1000 + k,
                    heldout_fraction=0.0)
        for k, t in enumerate(worker_tokens(setup, split))
    ]


def heldout_batches(setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows spread evenly over the held-out stdlib modules (the same for every method)."""
    stream = TokenStream(load_tokens(heldout_paths()), batch_size=setup.eval_batch_size, seq_len=setup.seq_len,
                         seed=0, heldout_fraction=0.99)
    return list(stream.eval_batches(setup.eval_batches))


def lr_at(setup: Setup, step: int) -> float:
    """Linear warm-up, then cosine decay to final_lr_frac of the peak at the last step."""
    warm = max(1, round(setup.warmup_frac * setup.steps))
    if step < warm:
        return setup.lr * (step + 1) / warm
    progress = (step - warm) / max(1, setup.steps - warm)
    floor = setup.final_lr_frac
    return setup.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def new_model(setup: Setup) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    cfg = ModelConfig(n_layer=setup.n_layer, n_embd=setup.n_embd, n_head=setup.n_head, block_size=setup.seq_len)
    model = build_model(cfg, seed=setup.seed)
    return model, torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)


def inner_step(setup: Setup, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, step: int) -> None:
    """One AdamW step on the mean loss over `batches` (one batch: a participant; M: DP)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(setup, step)
    for x, y in batches:
        _, loss = model(x, y)
        assert loss is not None
        (loss / len(batches)).backward()
    if setup.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def dp_bytes(setup: Setup, n_params: int, steps: int) -> int:
    """Ring all-reduce of the fp32 gradient: 2(M−1)/M × gradient bytes per worker per step."""
    m = setup.workers
    return round(steps * m * 2 * (m - 1) / m * 4 * n_params)


class Curve:
    """Held-out loss against tokens, evaluated every `eval_every` inner steps (or the round after)."""

    def __init__(self, setup: Setup, tokens_per_step: int | None = None) -> None:
        self.setup = setup
        self.tokens_per_step = tokens_per_step or setup.tokens_per_step
        self.batches = heldout_batches(setup)
        self.points: list[tuple[int, float]] = []
        self.next_at = 0

    def maybe(self, model: torch.nn.Module, step: int, force: bool = False) -> None:
        if step >= self.next_at or force:
            self.points.append((step * self.tokens_per_step, evaluate(model, self.batches)))
            while self.next_at <= step:
                self.next_at += self.setup.eval_every


# ---- the two kinds of run ----------------------------------------------------------------------


def run_dp(setup: Setup, method: Method, log: Any) -> dict[str, Any]:
    model, opt = new_model(setup)
    streams = worker_streams(setup, method.split)
    if method.kind == "solo":
        streams = streams[:1]
    curve = Curve(setup, len(streams) * setup.batch_size * setup.seq_len)
    curve.maybe(model, 0)
    for step in range(setup.steps):
        inner_step(setup, model, opt, [s.next_batch() for s in streams], step)
        curve.maybe(model, step + 1, force=step + 1 == setup.steps)
        if (step + 1) % 100 == 0:
            log(f"step {step + 1}/{setup.steps} eval {curve.points[-1][1]:.4f}")
    n = count_parameters(model)
    sent = dp_bytes(setup, n, setup.steps) if method.kind == "dp" else 0
    return {"curve": curve.points, "bytes": sent, "bytes_up": 0, "bytes_down": 0,
            "rounds": setup.steps, "params": n}


def encode(method: Method, delta: dict[str, torch.Tensor], feedback: ErrorFeedback | None) -> tuple[
        int, dict[str, torch.Tensor]]:
    """(bytes on the wire, Δ as the coordinator decodes it) for one upload."""
    if method.compression == "none":
        return EncodedBody(delta).content_length, delta
    if feedback is not None:
        tensors, meta = feedback.compress(delta, method.compression)
    else:
        tensors, meta = compress(delta, method.compression)
    return EncodedBody(tensors, meta).content_length, dict(decompress(tensors.items(), meta))


def run_fed(setup: Setup, method: Method, log: Any) -> dict[str, Any]:
    streams = worker_streams(setup, method.split)
    glob, glob_opt = new_model(setup)  # the coordinator's model, used for evaluation (and sync warm-up)
    curve = Curve(setup)
    curve.maybe(glob, 0)
    step, warm_bytes, n_params = 0, 0, count_parameters(glob)
    while step < method.sync_warmup:  # optional synchronous start (DiLoCo starts from a trained model)
        inner_step(setup, glob, glob_opt, [s.next_batch() for s in streams], step)
        step += 1
        curve.maybe(glob, step)
    warm_bytes = dp_bytes(setup, n_params, step)
    workers = [new_model(setup) for _ in streams]
    for _, opt in workers:
        opt.load_state_dict(copy.deepcopy(glob_opt.state_dict()))
    hp = outer_defaults(OuterConfig(algorithm=method.algorithm, lr=method.outer_lr))  # type: ignore[arg-type]
    outer = OuterOptimizer(dict(glob.named_parameters()), method.algorithm, hp)
    acc = RunningSum(outer.params)
    feedback = [ErrorFeedback() if method.error_feedback else None for _ in streams]
    up = down = rounds = 0
    while step < setup.steps:
        h = min(method.sync_every, setup.steps - step)
        tokens = {}
        deltas = []
        for k, ((model, opt), stream) in enumerate(zip(workers, streams, strict=True)):
            load_params(model, outer.params)
            for t in range(step, step + h):
                inner_step(setup, model, opt, [stream.next_batch()], t)
            nbytes, delta = encode(method, pseudo_gradient(outer.params, dict(model.named_parameters())), feedback[k])
            up += nbytes
            tokens[str(k)] = h * setup.batch_size * setup.seq_len
            deltas.append(delta)
        weights = contribution_weights(tokens)
        for k, delta in enumerate(deltas):
            acc.add(delta, weights[str(k)])
        outer.step(acc.mean())
        acc.reset()
        rounds += 1
        step += h
        # Every participant then downloads the new global model (fp32 safetensors, as served).
        down += setup.workers * EncodedBody(outer.params, {"version": str(rounds)}).content_length
        load_params(glob, outer.params)
        curve.maybe(glob, step, force=step == setup.steps)
        if rounds % max(1, 100 // method.sync_every) == 0:
            log(f"round {rounds} step {step}/{setup.steps} eval {curve.points[-1][1]:.4f}")
    return {"curve": curve.points, "bytes": warm_bytes + up + down, "bytes_up": up, "bytes_down": down,
            "rounds": rounds, "params": n_params}


def load_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy weights in place, so the inner optimizer keeps pointing at the same tensors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def run_one(setup: Setup, method: Method, threads: int) -> dict[str, Any]:
    """One method from scratch, in this process; deterministic for given (setup, method)."""
    torch.set_num_threads(threads)
    torch.manual_seed(setup.seed)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{method.name} {time.perf_counter() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    result = (run_fed if method.kind == "fed" else run_dp)(setup, method, log)
    result.update(name=method.name, wall_s=time.perf_counter() - t0, final=result["curve"][-1][1],
                  tokens=result["curve"][-1][0])
    log(f"done: eval {result['final']:.4f}, {result['bytes'] / 1e6:.1f} MB, {result['wall_s']:.0f}s")
    return result


# ---- orchestration and cache ------------------------------------------------------------------


def cache_key(setup: Setup, method: Method) -> str:
    blob = json.dumps([dataclasses.asdict(setup), dataclasses.asdict(method), torch.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_all(setup: Setup, todo: list[Method], jobs: int, threads: int, cache: Path | None) -> dict[str, dict]:
    results: dict[str, dict] = {}
    pending = []
    for m in todo:
        path = cache / f"{m.name}-{cache_key(setup, m)}.json" if cache else None
        if path is not None and path.is_file():
            results[m.name] = json.loads(path.read_text())
            print(f"[{m.name}] from cache {path}", file=sys.stderr)
        else:
            pending.append((m, path))

    def keep(m: Method, path: Path | None, res: dict) -> None:
        results[m.name] = res
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res))

    if jobs <= 1:
        for m, path in pending:
            keep(m, path, run_one(setup, m, threads))
    else:  # spawn: fresh interpreters, no forked torch thread pools
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(run_one, setup, m, threads): (m, path) for m, path in pending}
            for fut in cf.as_completed(futures):
                keep(*futures[fut], fut.result())
    return {m.name: results[m.name] for m in todo}


# ---- report ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model and fewer steps (a few minutes)")
    ap.add_argument("--out-dir", type=Path, help="where quality.md and quality.png go (default docs/)")
    ap.add_argument("--only", nargs="+", metavar="RUN", help="run only these (names from the table)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--cache", type=Path, help="directory of finished runs to reuse and extend")
    ap.add_argument("--steps", type=int, help="override the inner steps per participant")
    args = ap.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.steps:
        setup = dataclasses.replace(setup, steps=args.steps)
    todo = methods()
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in todo})
        if unknown:
            ap.error(f"unknown runs {', '.join(unknown)}; known: {', '.join(m.name for m in todo)}")
        todo = [m for m in todo if m.name in args.only]
    default_out = Path(tempfile.gettempdir()) / "fedtrain-quality-quick" if args.quick else Path("docs")
    out = args.out_dir or default_out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(setup, todo, args.jobs, args.threads, args.cache)
    total = time.perf_counter() - t0
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_markdown(out / "quality.md", setup, todo, results, command.strip(), total)
    plot(out / "quality.png", todo, results)
    print("\n".join(table(todo, results)))
    print("\n".join(goals(results)))
    print(f"\nwrote {out / 'quality.md'} and {out / 'quality.png'} in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
