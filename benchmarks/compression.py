"""Compression of pseudo-gradients (issue #32): seconds to compress and decompress at 100M
parameters per scheme, bytes against fp32, the coordinator's memory folding sparse updates, and
the cost of compressed downloads.

    python benchmarks/compression.py                # 100M parameters (~4 minutes here)
    python benchmarks/compression.py --params 10e6  # any size
    python benchmarks/compression.py --only downloads
    python benchmarks/compression.py --only uploads --schemes e3m0,int2,ternary  # some schemes
    python benchmarks/compression.py --only merge-memory  # the coordinator's peak RSS over a merge

The "model" is a stack of square float32 matrices (4096 x 4096, the last one cut to size)
holding a random Δ (normal, scaled per row as a pseudo-gradient's rows differ). For each scheme:

- `compress`: `compress(Δ)` alone; `+ feedback`: `ErrorFeedback.compress(Δ)`, what a participant
  runs (compress Δ + e, decode what was sent, keep the rest): both on the participant;
- `decompress`: the body's tensors back to full tensors (`decompress`);
- `fold`: what the coordinator does with one update: decode it (`decode_parts`, every offset
  and scale checked) and fold it into a `RunningSum` (a topk update by `index_add_`, never
  densified);
- `bytes`: the body's tensor bytes, and their ratio to fp32.

Then the coordinator's memory: a child process holds a running sum of the model (its fp32
copy) and folds N topk updates read from spool files, N = 1, 2, 4; its peak RSS (VmHWM) above
what it held before the first fold, and its whole peak in model bytes, should not grow with N.

Compressed downloads (`wire/delta.py`), per scheme of `train.download_compression`:
- `encode`: the coordinator's half after an outer step, `encode_delta`: D = (G - P) + E, C =
  codec(D), P' = P + decode(C) into the master weights, E' = D - decode(C) (one tensor at a time);
- `apply`: the participant's `apply_delta` (P + decode(C), in place into its copy of P);
- `digest`: the participant's check of the result, the digest of the version's body;
- `whole`: the digest of a whole model body, for scale (what a whole download is checked with);
- `bytes`: the delta body, and its ratio to the whole fp32 model's body.
Then the coordinator's peak RSS over a merge (DiLoCo's Nesterov step from a running sum, then
the delta), with compressed downloads off and on, in model bytes (a child process each); on,
side by side: P_r copied in memory before the step (`copy`, the coordinator before it read P_r
back from its file) and read back from version r's model file tensor by tensor (`file`, now).
`representation` (10M parameters at most): how dense the round's aggregate of M topk 1% updates
is, against how dense the outer step's move of the weights is after DiLoCo's Nesterov step:
why downloads send a compressed delta of the published weights, not the sparse aggregate.
Times are medians of `--repeat` (3) runs on this machine's CPUs (`torch.get_num_threads()`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from fedtrain.merge import RunningSum
from fedtrain.wire import EncodedBody, iter_file, read_tensors, write_file
from fedtrain.wire.compress import Codec, ErrorFeedback, compress, decode_parts, decompress
from fedtrain.wire.delta import DeltaInfo, apply_delta, encode_delta, target_body

SCHEMES: dict[str, Codec] = {
    "none": Codec("none"),
    "bf16": Codec("bf16"),
    "int8": Codec("int8"),
    "e3m0": Codec("e3m0"),
    "int2": Codec("int2"),
    "int2 deflated": Codec("int2", deflate=True),
    "int2/128 deflated": Codec("int2", 128, deflate=True),
    "int2/64 deflated": Codec("int2", 64, deflate=True),
    "int2/64 deflated bf16": Codec("int2", 64, deflate=True, bf16_scales=True),
    "ternary": Codec("ternary"),
    "int1": Codec("int1"),
    "topk 1% 2-bit": Codec("topk", k=41, chunk=4096, bits=2),
    "topk 2% 2-bit": Codec("topk", k=82, chunk=4096, bits=2),
    "topk 5% 4-bit": Codec("topk", k=205, chunk=4096, bits=4),
}
SIDE = 4096


def model_tensors(params: int, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors of a random Δ, one at a time."""
    g = torch.Generator().manual_seed(seed)
    left, i = params, 0
    while left > 0:
        rows = min(SIDE, -(-left // SIDE))
        t = torch.randn(rows, SIDE, generator=g) * torch.rand(rows, 1, generator=g) * 1e-3
        if t.numel() > left:  # the last one, cut to size (flat)
            t = t.reshape(-1)[:left].clone()
        yield f"layer{i}.weight", t
        left -= t.numel()
        i += 1


def model_delta(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(model_tensors(params, seed))


def timed(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drain(items: Iterable[object]) -> None:
    for _ in items:
        pass


def fold(tensors: dict[str, torch.Tensor], meta: dict[str, str], acc: RunningSum, shapes: dict) -> None:
    acc.reset()
    for name, at, values in decode_parts(tensors.items(), meta, None, shapes):
        if at is None:
            acc.fold(name, values, 1.0)
        else:
            acc.fold_sparse(name, at, values, 1.0)
    acc.finish_contribution(1.0)


def bench(params: int, repeat: int) -> None:
    delta = model_delta(params)
    shapes = {n: tuple(t.shape) for n, t in delta.items()}
    fp32 = sum(t.numel() * 4 for t in delta.values())
    acc = RunningSum(delta)
    print(f"{sum(t.numel() for t in delta.values()) / 1e6:.0f}M parameters ({fp32 / 1e6:.0f} MB fp32), "
          f"{torch.get_num_threads()} threads, median of {repeat}")
    print("| scheme | compress s | + feedback s | decompress s | fold s | body MB | vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, codec in SCHEMES.items():
        if schemes and label not in schemes:
            continue
        tensors, meta = compress(delta, codec)
        nbytes = EncodedBody(tensors, meta).content_length
        c = timed(lambda codec=codec: compress(delta, codec), repeat)
        fb = ErrorFeedback()
        f = timed(lambda codec=codec, fb=fb: fb.compress(delta, codec), repeat) if codec.scheme != "none" else c
        d = timed(lambda t=tensors, m=meta: drain(decompress(t.items(), m, None, shapes)), repeat)
        fo = timed(lambda t=tensors, m=meta: fold(t, m, acc, shapes), repeat)
        print(f"| {label} | {c:.2f} | {f:.2f} | {d:.2f} | {fo:.2f} | {nbytes / 1e6:.2f} | {fp32 / nbytes:.1f}x |")
        del tensors, fb


#: `--schemes`: the labels to run (empty: every scheme).
schemes: set[str] = set()
DOWNLOADS: dict[str, Codec] = {k: v for k, v in SCHEMES.items()
                               if k in ("int8", "e3m0", "int2", "int2 deflated", "int2/64 deflated bf16", "ternary",
                                        "int1", "topk 1% 2-bit", "topk 5% 4-bit")}


def downloads(params: int, repeat: int) -> None:
    """Compressed downloads: the coordinator's encode and the participant's apply and check."""
    prev = {n: t * 1e3 for n, t in model_delta(params, seed=7).items()}  # P: weights of order 1
    step = model_delta(params, seed=8)  # G - P: an outer step
    g = {n: prev[n] + step[n] for n in prev}
    whole = EncodedBody(prev, {"version": "1"})
    w = timed(lambda: EncodedBody(prev, {"version": "1"}).digest(), repeat)
    print(f"\ncompressed downloads at {params / 1e6:.0f}M parameters (whole model body "
          f"{whole.content_length / 1e6:.0f} MB, its digest {w:.2f} s)")
    print("| scheme | encode s (coordinator) | apply s (participant) | digest s (participant) | body MB | vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, codec in DOWNLOADS.items():
        if schemes and label not in schemes:
            continue
        times, residual = [], {n: torch.zeros_like(t) for n, t in prev.items()}
        for _ in range(repeat):
            new = {n: t.clone() for n, t in g.items()}
            start = time.perf_counter()
            tensors, meta, left = encode_delta(prev, new, residual, codec)
            times.append(time.perf_counter() - start)
        held = {n: t.clone() for n, t in prev.items()}
        applied = []
        for _ in range(repeat):
            for n, t in prev.items():
                held[n].copy_(t)
            start = time.perf_counter()
            result = apply_delta(held, tensors, meta, out=held)
            applied.append(time.perf_counter() - start)
        assert all(torch.equal(result[n], new[n]) for n in new)  # bit for bit, the coordinator's weights
        info = DeltaInfo(0, 1, "xxh3-128:" + "0" * 32, {"version": "1"})
        d = timed(lambda r=result, i=info: target_body(r, i).digest(), repeat)
        nbytes = EncodedBody(tensors, meta).content_length
        print(f"| {label} | {statistics.median(times):.2f} | {statistics.median(applied):.2f} | {d:.2f} | "
              f"{nbytes / 1e6:.2f} | {whole.content_length / nbytes:.1f}x |")
        del tensors, left, new, held, result


def representation(params: int, rounds: int = 5) -> None:
    """Why the compressed outer-step delta and not the sparse aggregate with a replicated outer
    step: how dense the round's aggregate of M topk 1% updates is, and how dense G - P is after
    DiLoCo's Nesterov step (momentum 0.9), round by round."""
    from fedtrain.merge import OuterOptimizer

    codec = SCHEMES["topk 1% 2-bit"]
    shapes = {n: tuple(t.shape) for n, t in model_tensors(params, seed=0)}
    print(f"\nthe round's aggregate vs the outer step's delta ({params / 1e6:.0f}M parameters, topk 1% uploads, "
          "DiLoCo outer lr 0.7, momentum 0.9)")
    print("| M | round | aggregate nonzero | G - P nonzero |")
    print("|---:|---:|---:|---:|")
    for m in (2, 4):
        outer = OuterOptimizer(model_delta(params, seed=99), "diloco", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
        for r in range(rounds):
            acc = RunningSum({n: (torch.float32, s) for n, s in shapes.items()})
            for i in range(m):
                tensors, meta = compress(model_delta(params, seed=1000 * r + i), codec)
                for name, at, values in decode_parts(tensors.items(), meta, None, shapes):
                    assert at is not None
                    acc.fold_sparse(name, at, values, 1.0)
                acc.finish_contribution(1.0)
            total, divisor = acc.scaled()
            nonzero = sum(int((t != 0).sum()) for t in total.values()) / params
            before = {n: t.clone() for n, t in outer.params.items()}
            outer.step(total, divisor, finite=True)
            moved = sum(int((outer.params[n] != before[n]).sum()) for n in before) / params
            print(f"| {m} | {r} | {nonzero:.2%} | {moved:.2%} |")


def merge_memory_child(params: int, scheme: str) -> None:
    """In a child: the coordinator's merge (DiLoCo's Nesterov step on a running sum) with
    compressed downloads `scheme` ("none": off; "<scheme> copy": P_r copied in memory before the
    step, as before #32's follow-up; "<scheme> file": P_r read back tensor by tensor from version
    r's model file, as the coordinator does now); its peak RSS in model bytes. Every merge
    writes the version's model file first, as the commit of the version before does (its
    memory is not counted: the peak is reset after it)."""
    from fedtrain.coordinator.model.checkpoints import CheckpointDir
    from fedtrain.coordinator.model.deltas import DownloadDeltas
    from fedtrain.coordinator.model.published_file import PublishedFile
    from fedtrain.merge import OuterOptimizer

    codec_name, _, mode = scheme.rpartition(" ") if scheme != "none" else ("none", "", "")
    baseline = _status("VmRSS")  # torch and the interpreter
    weights = model_delta(params, seed=7)
    outer = OuterOptimizer(weights, "diloco", {"lr": 0.4, "momentum": 0.9, "nesterov": True})
    del weights
    acc = RunningSum({n: (torch.float32, tuple(t.shape)) for n, t in outer.params.items()})
    deltas = DownloadDeltas()
    deltas.configure(None if codec_name == "none" else DOWNLOADS[codec_name])
    model_bytes = acc.nbytes
    with tempfile.TemporaryDirectory() as d:
        ckpt = CheckpointDir(Path(d))
        for r in range(3):  # the momentum and the residual exist from the first merge on
            digest = write_file(ckpt.global_path(r), outer.params)  # version r, committed
            if r:
                ckpt.remove(r - 1)
            acc.reset()
            for name, t in model_tensors(params, seed=10 + r):  # one update, folded as it comes
                acc.fold(name, t, 1.0)
            acc.finish_contribution(1.0)
            if r == 1:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            total, divisor = acc.scaled()
            kept = PublishedFile(ckpt, r, digest, outer.params, None) if mode == "file" else None
            prev = deltas.before_step(outer.params, None, kept)
            outer.step(total, divisor, finite=True)
            if prev is not None:
                deltas.encode(prev, outer.params)
                del prev
            if kept is not None:
                kept.close()
    peak = _status("VmHWM")
    print(f"| {scheme} | {(peak - baseline) / model_bytes:.2f} | {peak / model_bytes:.2f} |")


def merge_memory(params: int) -> None:
    print(f"\ncoordinator peak RSS over a merge (DiLoCo, {params / 1e6:.0f}M parameters), in model bytes")
    print("| download_compression, P_r | peak above torch's baseline / model bytes | peak RSS / model bytes |")
    print("|---|---:|---:|")
    for scheme in ("none", "int8 copy", "int8 file", "topk 1% 2-bit copy", "topk 1% 2-bit file"):
        subprocess.run([sys.executable, __file__, "--params", str(params), "--merge-memory-child", scheme],
                       check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def rss_child(files: list[str], params: int) -> None:
    """In a child: a running sum of the model, then N topk updates folded from their files."""
    shapes = {n: tuple(t.shape) for n, t in model_delta(params).items()}
    acc = RunningSum({n: (torch.float32, s) for n, s in shapes.items()})
    model_bytes = acc.nbytes
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for path in files:
        meta: dict[str, str] = {}
        tensors = read_tensors(iter_file(Path(path)), on_header=lambda _, m, meta=meta: meta.update(m))
        for name, at, values in decode_parts(tensors, meta, None, shapes):
            assert at is not None
            acc.fold_sparse(name, at, values, 1.0)
        acc.finish_contribution(1.0)
    peak = _status("VmHWM")
    print(f"| {len(files)} | {(peak - before) / 1e6:.1f} | {peak / model_bytes:.2f} |")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss(params: int) -> None:
    codec = SCHEMES["topk 1% 2-bit"]
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i in range(4):
            tensors, meta = compress(model_delta(params, seed=i + 1), codec)
            path = Path(d) / f"u{i}.safetensors"
            write_file(path, tensors, meta)
            files.append(str(path))
        print("\ncoordinator folding N topk 1% updates from spool files (peak RSS above the sum; whole peak in "
              "model bytes)")
        print("| N | peak above the sum MB | peak RSS / model bytes |")
        print("|---:|---:|---:|")
        for n in (1, 2, 4):
            subprocess.run([sys.executable, __file__, "--params", str(params), "--rss-child", *files[:n]], check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("uploads", "memory", "downloads", "merge-memory", "representation"),
                    help="run one part only")
    ap.add_argument("--schemes", default="", help="comma-separated scheme labels to run (uploads, downloads); "
                    "default: all")
    ap.add_argument("--rss-child", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--merge-memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    params = int(args.params)
    if args.rss_child is not None:
        rss_child(args.rss_child, params)
        return
    if args.merge_memory_child is not None:
        merge_memory_child(params, args.merge_memory_child)
        return
    schemes.update(x.strip() for x in args.schemes.split(",") if x.strip())
    if args.only in (None, "uploads"):
        bench(params, args.repeat)
    if args.only in (None, "memory"):
        rss(params)
    if args.only in (None, "downloads"):
        downloads(params, args.repeat)
    if args.only in (None, "downloads", "merge-memory"):
        merge_memory(params)
    if args.only in (None, "representation"):
        representation(min(params, 10_000_000))


if __name__ == "__main__":
    main()
