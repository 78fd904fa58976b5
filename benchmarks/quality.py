"""Learning quality: DiLoCo, Streaming DiLoCo, FedAvg and FedOpt against synchronous data parallelism, same tokens.

An in-process simulation of a run of M participants (`quality_sim.py`: each its own model and
AdamW inner optimizer, Δs merged as the coordinator merges them, bytes counted as sent). The
baseline is synchronous data parallelism with M workers, simulated by accumulating the
gradients of M micro-batches (one from each participant's stream, so every method sees the
very same tokens) into one AdamW step. Every method gets the same inner learning-rate
schedule shape, seeds and token budget, and the global model is evaluated on the fixed
held-out stdlib modules (`heldout_paths()`). Two studies:

- `tokens5` (the default): M = 4, 2.05 M tokens (about 5 per parameter), H ∈ {10, 50, 100},
  FedAvg, FedAdam, IID, int8, warm-up (issue #3).
- `tokens20`: about 20 tokens per parameter (8.97 M tokens) at M = 2 and 4: DP, DiLoCo and
  Streaming DiLoCo at H = 30, FedAvg, an outer-lr sweep; and at 2.05 M tokens an outer-lr
  sweep over H (issue #21). One run of 8.97 M tokens takes about 13 min of one core.
- `compress20`: the tokens20 budget at M = 2 and 4, H = 30: DP, fp32 DiLoCo, int8, e3m0 and topk
  (1% and 3%, 2-bit) uploads, each with whole-model or compressed downloads (or, derived in the
  report, the relayed sparse aggregate), and Streaming DiLoCo K = 2 with a topk preset (issue #32;
  `quality_compress.py`, `quality_compress_report.py`).
- `dp20`: the tokens20 budget at M = 4: central DP (clip C, noise σ) against non-private DiLoCo,
  with the accountant's ε (issue #33).

    python benchmarks/quality.py                  # tokens5 (about an hour on 2 cores)
    python benchmarks/quality.py --quick          # a minute or two: smaller model, fewer steps
    python benchmarks/quality.py --study tokens20 --jobs 1 --cache DIR   # about 5 CPU-hours
    python benchmarks/quality.py --study tokens20 --quick
    python benchmarks/quality.py --only dp diloco-h100 --cache /tmp/quality-cache
    python benchmarks/quality.py --study tokens20 --cache DIR --cached-only   # report what is done
    python benchmarks/quality.py --study compress20 --quick   # a minute; then --study dp20 --quick

Writes `quality.md` (tokens5 and tokens20 each fill their own generated block; hand-written
text outside it is kept on a rerun) and a plot (`quality.png`, `quality-tokens20.png`) into
--out-dir (default docs/, or a temporary directory with --quick). `--cache DIR` keeps one JSON
per finished run, keyed by its settings and written as soon as the run ends, so an
interrupted or extended study only runs what is missing: rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from quality_compress_report import (
    compress_goals,
    compress_table,
    compress_text,
    dp_table,
    dp_text,
    plot_panels,
    with_relay,
)
from quality_report import goals, plot, plot_tokens20, table, tokens20_text, write_markdown
from quality_sim import RUNS, Log, Method, Setup, check_stream_is_diloco

FULL = Setup()
QUICK = Setup(n_layer=1, n_embd=64, n_head=2, seq_len=32, steps=200, eval_every=20, eval_batches=8)
# 20 tokens per parameter for the built-in 437,760-parameter model: 8760 steps at M = 2 (4380 at
# M = 4) of 8×64 tokens per participant is 8.97 M tokens, a multiple of H = 30 at both M (K = 4
# at H = 32 ends on a flush); the short budget is tokens5's 2.05 M (2000 steps at M = 2, 1000 at M = 4).
TOKENS20 = Setup(workers=2, steps=8760, short_steps=2000, eval_every=150)
QUICK20 = Setup(n_layer=2, n_embd=64, n_head=2, seq_len=32, workers=2, steps=240, short_steps=120, eval_every=40,
                eval_batches=8)


def methods() -> list[Method]:
    """Every run of the tokens5 study, most important first."""
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


# The outer lr grid of the 2.05 M-token sweep, by H. At H = 10 tokens5 measured lr 0.7 far worse
# than 0.1 (2.513 vs 1.913, M = 4), so its grid reaches down to 0.1 and leaves out 1.0.
SHORT_GRID = {10: (0.1, 0.4, 0.7), 30: (0.4, 0.7, 1.0), 100: (0.4, 0.7, 1.0)}


def methods_tokens20() -> list[Method]:
    """Every run of the tokens20 study, most important first. Outer lrs are pinned (not the
    defaults), so that a later change of `outer_defaults` cannot reuse a cached run under a new
    meaning. K = 4 needs H divisible by 4: H = 32 (S = 8), the nearest multiple above 30, so
    that K = 4 never syncs more often than DiLoCo at H = 30."""
    ms = (2, 4)

    def stream(m: int, h: int, k: int, tau: int) -> Method:
        return Method(f"m{m}-stream-h{h}-k{k}-t{tau}", "main", kind="stream", sync_every=h, outer_lr=0.7,
                      workers=m, fragments=k, fragment_split="strided" if k == 2 else "sublayer", overlap=tau,
                      alpha=0.5)

    out = [Method(f"m{m}-dp", "main", kind="dp", workers=m) for m in ms]
    out += [Method(f"m{m}-diloco-h30", "main", sync_every=30, outer_lr=0.7, workers=m) for m in ms]
    out += [stream(m, 30, 2, tau) for m in ms for tau in (1, 5)]
    out += [stream(m, 32, 4, tau) for m in ms for tau in (1, 5)]
    out += [Method(f"m{m}-fedavg-h30", "main", algorithm="fedavg", sync_every=30, outer_lr=1.0, workers=m) for m in ms]
    out += [Method(f"m{m}-diloco-h30-lr{lr:g}", "tuning", sync_every=30, outer_lr=lr, workers=m)
            for m in ms for lr in (0.4, 1.0, 0.55, 0.85)]
    # The H trend at the full budget: at 2.05 M tokens the best lr at H = 30 (0.4) did not carry over.
    out += [Method(f"m{m}-diloco-h{h}-lr{lr:g}", "tuning", sync_every=h, outer_lr=lr, workers=m)
            for h, lrs in ((10, (0.4, 0.7)), (100, (0.7, 1.0))) for m in ms for lr in lrs]
    out += [Method(f"m{m}-short-dp", "short", kind="dp", workers=m, budget="short") for m in ms]
    out += [Method(f"m{m}-short-diloco-h{h}-lr{lr:g}", "short", sync_every=h, outer_lr=lr, workers=m, budget="short")
            for h in (10, 100, 30) for m in ms for lr in SHORT_GRID[h]]
    return out


# Issue #32's presets: each uploads with the participants' error feedback; "-both" also downloads
# the compressed delta of the new model (the coordinator's error feedback), "-up" the whole model
# (the report also counts "-up" runs as relayed: the sparse aggregate instead of the model, with a
# replicated outer step; same math, other download bytes). "-fedavg": outer SGD lr 1 without
# momentum, as SparseLoCo (the error feedback accumulates like momentum); the others DiLoCo's
# outer Nesterov, lr 0.7, momentum 0.9, which with topk's error feedback stalled (up) or diverged
# (both) in the first measured runs.
PRESETS: dict[str, dict[str, Any]] = {
    "int8": dict(compression="int8", error_feedback=True),
    "e3m0": dict(compression="e3m0", error_feedback=True),
    "topk1": dict(compression="topk", density=0.01, bits=2, error_feedback=True),
    "topk3": dict(compression="topk", density=0.03, bits=2, error_feedback=True),
    "topk1-fedavg": dict(compression="topk", density=0.01, bits=2, error_feedback=True, algorithm="fedavg",
                         outer_lr=1.0),
    "topk3-fedavg": dict(compression="topk", density=0.03, bits=2, error_feedback=True, algorithm="fedavg",
                         outer_lr=1.0),
    # Added when topk1-fedavg came out at +3.5% with 1,200× fewer bytes than DP relayed (M = 2): the
    # densest topk whose relay still fits 250× at M = 4 (about 57 KB a body).
    "topk5-fedavg": dict(compression="topk", density=0.05, bits=2, error_feedback=True, algorithm="fedavg",
                         outer_lr=1.0),
    # Added when topk5-fedavg came out at +1.10% (M = 2): density alone closes the gap slowly (1%, 3%,
    # 5%: +3.55, +1.50, +1.10%); 4-bit values cost ~14% more bytes than 2-bit and tell how much of
    # the gap is the values' quantization rather than the sparsity.
    "topk5b4-fedavg": dict(compression="topk", density=0.05, bits=4, error_feedback=True, algorithm="fedavg",
                           outer_lr=1.0),
    # Added when topk5b4-fedavg missed at M = 4 (+3.33%, where fp32 FedAvg is already +1.87% behind
    # DiLoCo's Nesterov step): SparseLoCo's decayed error feedback (β < 1), which it reports stands in
    # for the outer momentum.
    "topk5b4-ef95": dict(compression="topk", density=0.05, bits=4, error_feedback=True, ef_decay=0.95,
                         algorithm="fedavg", outer_lr=1.0),
    # Added when ef95 gained little at M = 4 (1.5111 against 1.5156): DiLoCo's own Nesterov (lr 0.7,
    # μ 0.9), applied by each participant to its Δ before compression (`train.upload_momentum`, Deep
    # Gradient Compression's momentum correction); the coordinator's step is plain SGD at lr 0.7.
    "topk5b4-lm": dict(compression="topk", density=0.05, bits=4, error_feedback=True, up_momentum=0.9,
                       algorithm="fedavg", outer_lr=0.7),
    # Added when topk5b4-lm trained far worse at M = 4 (1.7371): dense 2-bit values (a scale per 256),
    # which keep DiLoCo's outer Nesterov as e3m0 does (+0.31% at M = 2) at half e3m0's bytes; MuLoCo
    # reports 2-bit updates with error feedback at no loss.
    "int2": dict(compression="int2", error_feedback=True),
    # Added when int2-both met the goal at M = 4 (1.4635, 310x) and, by its bytes, could not at M = 2
    # (DP sends fewer bytes there): the scaled sign (a block's mean |value|), half int2's bytes.
    "int1": dict(compression="int1", error_feedback=True),
    # Added when int1 trained far worse at M = 2 (+8.09%) and int2 missed there by a little (+0.59%):
    # a smaller block makes the absmax scale more local, so int2's inner level (a third of it) sits
    # nearer the block's typical value; its bytes measured with the entropy-coded codes.
    "int2-b128": dict(compression="int2", error_feedback=True, block=128),
    "int2-b64": dict(compression="int2", error_feedback=True, block=64),
    # Added with int2-b128: 1.6 bits a value (five base-3 codes a byte), the bytes M = 2 needs
    # (int2's 211x × 1.22); -1, 0 or 1 times the mean |value| of those over 0.7 × the block's mean
    # |value| (ternary weights, Li et al. 2016): less error than int2's on the measured Δs (0.44
    # of the norm against 0.62).
    "ternary": dict(compression="ternary", error_feedback=True),
    # Added when int2 at a block of 64 came out at +0.05% (M = 2) and 182x, ternary at +1.54% and
    # 257x: int2's codes deflated (`train.entropy_coding`), lossless, so these train exactly as
    # int2-b128 / int2-b64 do (a check of it) and send 1.3-1.5 bits a value instead of 2.
    "int2-b128-z": dict(compression="int2", error_feedback=True, block=128, deflate=True),
    "int2-b64-z": dict(compression="int2", error_feedback=True, block=64, deflate=True),
    # Added when int2 at 128 values a scale came out at +0.52% (M = 2; 1.4392) and at 64 at +0.05%
    # (M = 2) but 226-231x deflated with fp32 scales: bf16 scales (`train.compression_scale`) halve
    # the scales' 0.5 bits a value at 64, about 256-262x deflated on the measured Δs.
    "int2-b64-zh": dict(compression="int2", error_feedback=True, block=64, deflate=True, bf16_scales=True),
}


def _fed20(m: int, tag: str, **kw: Any) -> Method:
    """DiLoCo at the tokens20 budget, H = 30, outer lr 0.7 (pinned unless `kw` says), M = m."""
    kw = {"outer_lr": 0.7, **kw}
    return Method(f"m{m}-{tag}", kw.pop("group", "main"), sync_every=30, workers=m, **kw)


def _preset(m: int, name: str, both: bool) -> Method:
    return _fed20(m, f"{name}-{'both' if both else 'up'}", **PRESETS[name], download=both)


def methods_compress20() -> list[Method]:
    """Issue #32's study, most telling first: DP, fp32 DiLoCo and top-k 1% both ways at M = 2;
    M = 4's DiLoCo (whose Δ norms dp20's C comes from); the SparseLoCo-like presets (topk with an
    outer SGD without momentum) at both M; then the rest. `FIRST`: the runs before dp20's."""
    def stream(m: int, preset: str = "topk3-fedavg") -> Method:
        kw = {**PRESETS[preset], "outer_lr": 1.0}
        return Method(f"m{m}-stream-k2-{preset}-up", "main", kind="stream", sync_every=30, workers=m,
                      fragments=2, fragment_split="strided", overlap=1, alpha=0.5, **kw)

    dp = {m: Method(f"m{m}-dp", "main", kind="dp", workers=m) for m in (2, 4)}
    diloco = {m: _fed20(m, "diloco-h30") for m in (2, 4)}
    out = [dp[2], diloco[2], _preset(2, "topk1", True), diloco[4]]
    out += [_preset(2, "topk1-fedavg", False), _preset(2, "topk3-fedavg", False), dp[4]]
    out += [_preset(4, "topk1-fedavg", False), _preset(4, "topk3-fedavg", False)]
    out += [_preset(m, "e3m0", True) for m in (2, 4)] + [stream(2)]
    out += [_preset(m, "topk5-fedavg", both) for both in (False, True) for m in (2, 4)]
    out += [_preset(m, "int8", True) for m in (2, 4)] + [stream(4)]
    out += [_preset(m, "topk3-fedavg", True) for m in (2, 4)] + [_preset(4, "topk1", True)]
    out += [_preset(m, name, False) for name in ("topk1", "e3m0", "int8") for m in (2, 4)]
    out += [_preset(m, "topk3", True) for m in (2, 4)] + [_preset(m, "topk3", False) for m in (2, 4)]
    out += [_preset(m, "topk5b4-fedavg", False) for m in (2, 4)]
    # the best preset (topk5b4-fedavg: +0.22% at 397x, M = 2) with Streaming DiLoCo K = 2, as #32 asks
    out += [stream(m, "topk5b4-fedavg") for m in (2, 4)]
    out += [_preset(m, "topk5b4-ef95", False) for m in (4, 2)]
    out += [_preset(m, "topk5b4-lm", False) for m in (4, 2)]
    out += [_preset(m, "int2", True) for m in (4, 2)]
    out += [_preset(m, "int1", True) for m in (2, 4)]
    out += [_preset(m, name, True) for name in ("int2-b128", "int2-b64") for m in (2, 4)]
    out += [_preset(m, "ternary", True) for m in (2, 4)]
    out += [_preset(m, name, True) for name in ("int2-b128-z", "int2-b64-z") for m in (2, 4)]
    out += [_preset(m, "int2-b64-zh", True) for m in (2, 4)]
    # The seed-to-seed spread behind "vs fp32 DiLoCo": the same runs at another model init and data
    # order (seed 1), added when int2's block sizes moved the M = 2 and M = 4 results by up to
    # 0.6 points in opposite directions (b64: +0.05% and +0.54%; b256: +0.59% and -0.22%).
    out += [_fed20(m, "diloco-h30-seed1", seed=1) for m in (2, 4)]
    out += [_fed20(m, "int2-b64-zh-both-seed1", **PRESETS["int2-b64-zh"], download=True, seed=1) for m in (2, 4)]
    # The recommended preset with Streaming DiLoCo K = 2 (as #32 asks of the best preset): DiLoCo's
    # outer Nesterov at lr 0.7 per fragment, compressed both ways.
    out += [Method(f"m{m}-stream-k2-int2-b64-zh-both", "main", kind="stream", sync_every=30, workers=m, fragments=2,
                   fragment_split="strided", overlap=1, alpha=0.5, outer_lr=0.7, **PRESETS["int2-b64-zh"],
                   download=True) for m in (2, 4)]
    return out


#: The compress20 runs the background chain runs before dp20 (docs/quality.md, Running).
FIRST = 12


# dp20: C from the measured Δ norms of fp32 DiLoCo at M = 4 (`delta_norms` of m4-diloco-h30: p10 1.17,
# median 4.17, p90 5.51, max 6.22 over its 146 rounds × 4 participants): C = 4, about the median (the
# target of adaptive clipping, Andrew et al. 2021), so about half the Δs are clipped, by at most 1.6×.
# σ from the config's least (0.01) up: the noise on the mean is σ·C/M per coordinate (σ at M = 4),
# on 437,760 coordinates, against a mean Δ of norm at most C.
DP_CLIP = 4.0
DP_NOISES = (0.01, 0.03, 0.1)


def methods_dp20() -> list[Method]:
    """Issue #33's study at M = 4: non-private DiLoCo (shared with compress20), clipping alone, then
    central DP at each σ (C = DP_CLIP), smallest noise first."""
    out = [_fed20(4, "diloco-h30"), Method("m4-dp", "main", kind="dp", workers=4)]
    out += [_fed20(4, f"diloco-h30-dp{s:g}", clip=DP_CLIP, noise=s) for s in DP_NOISES]
    out.append(_fed20(4, "diloco-h30-clip", clip=DP_CLIP))
    return out


STUDIES: dict[str, tuple[Setup, Setup, Callable[[], list[Method]]]] = {
    "tokens5": (FULL, QUICK, methods),
    "tokens20": (TOKENS20, QUICK20, methods_tokens20),
    "compress20": (TOKENS20, QUICK20, methods_compress20),
    "dp20": (TOKENS20, QUICK20, methods_dp20),
}


def run_one(setup: Setup, method: Method, threads: int) -> dict[str, Any]:
    """One method from scratch, in this process; deterministic for given (setup, method)."""
    torch.set_num_threads(threads)
    torch.manual_seed(setup.seed)
    log = Log(method.name)
    log(f"start: M={setup.workers}, {setup.steps} inner steps, {setup.steps * setup.tokens_per_step / 1e6:.2f} M "
        f"tokens; {method.describe()}")
    result = RUNS[method.kind](setup, method, log)
    result = {k: v for k, v in result.items() if not k.startswith("_")}  # tensors kept for checks only
    result.update(name=method.name, wall_s=time.perf_counter() - log.t0, final=result["curve"][-1][1],
                  tokens=result["curve"][-1][0], workers=setup.workers, steps=setup.steps)
    log(f"done: eval {result['final']:.4f}, {result['bytes'] / 1e6:.1f} MB, {result['wall_s']:.0f}s")
    return result


# ---- orchestration and cache ------------------------------------------------------------------

# Fields added after the tokens5 study was cached: left out of the key at their defaults, so its
# cached runs keep their keys.
NEW_FIELDS = {Setup: {"short_steps"}, Method: {"workers", "budget", "fragments", "fragment_split", "overlap", "alpha",
                                                "density", "bits", "download", "clip", "noise",
                                                "ef_decay", "up_momentum", "block", "deflate",
                                                "bf16_scales", "seed"}}


def _key_fields(obj: Any) -> dict[str, Any]:
    new = NEW_FIELDS[type(obj)]
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    return {k: v for k, v in dataclasses.asdict(obj).items() if k not in new or v != defaults[k]}


def cache_key(setup: Setup, method: Method) -> str:
    blob = json.dumps([_key_fields(setup), _key_fields(method), torch.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_all(setup: Setup, todo: list[Method], jobs: int, threads: int, cache: Path | None,
            cached_only: bool = False) -> dict[str, dict]:
    """Every run of `todo` from the cache or run now (each cached as soon as it ends)."""
    results: dict[str, dict] = {}
    pending = []
    for m in todo:
        s = setup.for_run(m)
        path = cache / f"{m.name}-{cache_key(s, m)}.json" if cache else None
        if path is not None and path.is_file():
            results[m.name] = json.loads(path.read_text())
            print(f"[{m.name}] from cache {path}", file=sys.stderr)
        elif not cached_only:
            pending.append((s, m, path))
    print(f"{len(results)} runs from the cache, {len(pending)} to run: {', '.join(m.name for _, m, _ in pending)}",
          file=sys.stderr, flush=True)

    def keep(m: Method, path: Path | None, res: dict) -> None:
        results[m.name] = res
        if path is not None:  # written whole, then renamed: a kill mid-write leaves no broken entry
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(res))
            os.replace(tmp, path)

    if jobs <= 1:
        for s, m, path in pending:
            keep(m, path, run_one(s, m, threads))
    else:  # spawn: fresh interpreters, no forked torch thread pools
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(run_one, s, m, threads): (m, path) for s, m, path in pending}
            for fut in cf.as_completed(futures):
                keep(*futures[fut], fut.result())
    return {m.name: results[m.name] for m in todo if m.name in results}


# ---- report ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=sorted(STUDIES), default="tokens5", help="which study (default tokens5)")
    ap.add_argument("--quick", action="store_true", help="smaller model and fewer steps (a minute or two)")
    ap.add_argument("--out-dir", type=Path, help="where quality.md and the plot go (default docs/)")
    ap.add_argument("--only", nargs="+", metavar="RUN", help="run only these (names from the table)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--cache", type=Path, help="directory of finished runs to reuse and extend")
    ap.add_argument("--cached-only", action="store_true", help="run nothing: report the runs found in --cache")
    ap.add_argument("--steps", type=int, help="override the inner steps per participant (at the setup's M)")
    args = ap.parse_args(argv)
    full, quick, study_methods = STUDIES[args.study]
    setup = quick if args.quick else full
    if args.steps:
        setup = dataclasses.replace(setup, steps=args.steps)
    todo = study_methods()
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in todo})
        if unknown:
            ap.error(f"unknown runs {', '.join(unknown)}; known: {', '.join(m.name for m in todo)}")
        todo = [m for m in todo if m.name in args.only]
    default_out = Path(tempfile.gettempdir()) / "fedtrain-quality-quick" if args.quick else Path("docs")
    out = args.out_dir or default_out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.study in ("tokens20", "compress20") and not args.cached_only:  # seconds, before hours of runs
        print(check_stream_is_diloco(setup.for_run(Method("check", "check", workers=2))), file=sys.stderr, flush=True)
    results = run_all(setup, todo, args.jobs, args.threads, args.cache, args.cached_only)
    todo = [m for m in todo if m.name in results]
    if not todo:
        print("no runs to report", file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    command = ("python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    runs = {m.name: setup.for_run(m) for m in todo}
    if args.study in ("compress20", "dp20"):
        md, png = out / "quality.md", out / f"quality-{args.study}.png"
        text = compress_text if args.study == "compress20" else dp_text
        text(md, setup, runs, todo, results, command, total)
        by_m = {w: [m for m in todo if runs[m.name].workers == w] for w in sorted({s.workers for s in runs.values()})}
        drawn = plot_panels(png, {f"M = {w}": ms for w, ms in by_m.items()}, results)
        print("\n".join(compress_table(*with_relay(todo, results, runs)) if args.study == "compress20"
                        else dp_table(todo, results, runs)))
        if args.study == "compress20":
            print("\n".join(compress_goals(*with_relay(todo, results, runs))))
    elif args.study == "tokens20":
        md, png = out / "quality.md", out / "quality-tokens20.png"
        tokens20_text(md, setup, runs, todo, results, command, total)
        drawn = plot_tokens20(png, todo, results)
        print("\n".join(table(todo, results, runs)))
    else:
        md, png = out / "quality.md", out / "quality.png"
        write_markdown(md, setup, runs, todo, results, command, total)
        drawn = plot(png, todo, results)
        print("\n".join(table(todo, results, runs)))
        print("\n".join(goals(results)))
    print(f"\nwrote {md}" + (f" and {png}" if drawn else " (no plot: matplotlib is missing)")
          + f" in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
