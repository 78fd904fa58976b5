"""The learning-quality study's simulation (`quality.py`): what one run is and how it trains.

M participants in one process: each has its own copy of the built-in byte-level GPT and its
own AdamW inner optimizer (kept across rounds) and trains on its own data; their Δ = θ_g − θᵢ
is merged exactly as the coordinator merges it (`fedtrain.merge`: token-weighted
`RunningSum`, then `OuterOptimizer.step`). Uploads are encoded as the participant encodes
them (`quality_compress.Uplink`: int8, e3m0 or topk, optional error feedback) and counted in
bytes with `EncodedBody.content_length`; downloads are the whole model or its compressed delta
with the coordinator's error feedback (`quality_compress.Downlink`); central DP clips and
noises as the coordinator does (`quality_compress.Privacy`). The baseline is synchronous data
parallelism with M workers, simulated by accumulating the gradients of M micro-batches (one
from each participant's stream, so every method sees the very same tokens) into one AdamW step.

Streaming DiLoCo (`run_stream`) follows `fedtrain.streaming`'s docstring: K fragments of the
parameter names (`study_fragments`), one `OuterOptimizer` per fragment, fragment n mod K sent
after step (n+1)·S − τ and applied after step (n+1)·S (`fedtrain.streaming.schedule`), Δ
against the fragment's global copy, θ ← (1−α)·θ_g + α·θ_local at the apply. One thing is the
study's own: nothing in torchft flushes at the end, but here every fragment whose last Δ
does not reach the last step syncs once more after it (τ = 0, one fragment per sync event),
so that the evaluated global model, like DiLoCo's after its last and maybe partial round,
has seen every token. K = 1, τ = 0, α = 0 is then DiLoCo bit for bit (`check_stream_is_diloco`).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from quality_compress import Downlink, Privacy, Uplink, codec_of, full_body_bytes, norm_summary

from fedtrain.config import ModelConfig, OuterConfig, RunConfig, outer_defaults
from fedtrain.merge import OuterOptimizer, RunningSum, contribution_weights, pseudo_gradient
from fedtrain.privacy.clipping import l2_norm
from fedtrain.recipes import (
    TokenStream,
    build_model,
    count_parameters,
    evaluate,
    heldout_paths,
    load_tokens,
    stdlib_shards,
)
from fedtrain.streaming import check_schedule, fragments, schedule

IID_CHUNK = 4096  # bytes per piece when the pooled corpus is dealt out at random (IID split)
BUDGETS = ("", "short")  # a study's main token budget, or its shorter one (Setup.short_steps)
SPLITS = ("strided", "sublayer")


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
    short_steps: int = 0  # the shorter budget of `budget="short"` runs, in inner steps at M = workers

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.seq_len

    def for_run(self, method: Method) -> Setup:
        """The setup `method` trains with: its M (else this one's) and its budget in tokens,
        the same for every M, so the steps are tokens / (M·batch·seq_len): each run keeps its
        inner-lr schedule over its own steps. Evaluations stay the same tokens apart."""
        if method.budget not in BUDGETS:
            raise ValueError(f"unknown budget {method.budget!r} of {method.name}; use one of {BUDGETS}")
        base = self.short_steps if method.budget == "short" else self.steps
        if base <= 0:
            raise ValueError(f"{method.name} asks for the short budget and the setup has none")
        workers = method.workers or self.workers
        per_step = workers * self.batch_size * self.seq_len
        return replace(self, workers=workers, steps=max(1, round(base * self.tokens_per_step / per_step)),
                       seed=self.seed + method.seed,
                       eval_every=max(1, round(self.eval_every * self.tokens_per_step / per_step)), short_steps=0)


@dataclass(frozen=True)
class Method:
    """One row of the table: the baseline, or a federated run with its outer optimizer and options."""

    name: str
    group: str  # main | tuning | investigation
    kind: str = "fed"  # dp | fed | stream (Streaming DiLoCo) | solo (participant 0 alone, 1/M of the tokens)
    algorithm: str = "diloco"
    sync_every: int = 0  # H
    outer_lr: float | None = None  # None: outer_defaults
    split: str = "noniid"  # noniid (stdlib_shards) | iid (pooled and dealt out at random)
    compression: str = "none"  # none | int8 | e3m0 | topk (uploads; `quality_compress.codec_of`)
    error_feedback: bool = False  # the participants' (upload) error feedback
    ef_decay: float = 1.0  # its β (`train.error_feedback_decay`): Δ + β·residual is compressed
    up_momentum: float = 0.0  # each participant's own outer Nesterov before compression (`train.upload_momentum`)
    density: float = 0.0  # topk: share of each chunk's values sent
    bits: int = 2  # topk: bits per value sent
    block: int = 256  # values per scale of a block codec (`train.compression_block`)
    deflate: bool = False  # a block codec's codes deflated both ways (`train.entropy_coding`): other bytes, same math
    bf16_scales: bool = False  # a block codec's scales in bf16 both ways (`train.compression_scale`)
    seed: int = 0  # added to the setup's seed: another model init and data order (the seed-to-seed spread)
    download: bool = False  # downloads compressed with the upload codec, server-side error feedback
    clip: float = 0.0  # central DP: each Δ clipped to this L2 norm (0: no clipping)
    noise: float = 0.0  # central DP: σ, the noise multiplier (0: no noise)
    sync_warmup: int = 0  # first inner steps trained as synchronous DP, then federated from there
    workers: int = 0  # M; 0: the setup's
    budget: str = ""  # "": the study's token budget; "short": its shorter one
    fragments: int = 1  # Streaming DiLoCo's K
    fragment_split: str = "strided"  # strided: by block; sublayer: each block's attention and MLP halves
    overlap: int = 0  # τ, inner steps between sending a fragment and applying it
    alpha: float = 0.0  # α, the local side's weight when the global fragment is mixed in

    def outer_hp(self) -> dict[str, Any]:
        lr = self.outer_lr
        if lr is None and self.algorithm == "diloco":
            lr = 0.7  # DiLoCo's default when the tokens5 study ran: pinned, so that its cached runs keep their meaning
        return outer_defaults(RunConfig(outer=OuterConfig(algorithm=self.algorithm, lr=lr)))  # type: ignore[arg-type]

    def describe(self) -> str:
        if self.kind == "dp":
            return "synchronous data-parallel (AdamW, grad accumulation over M micro-batches)"
        if self.kind == "solo":
            return "one participant alone on its shard (¼ of the tokens), no communication"
        lr = f"outer lr {self.outer_hp()['lr']:g}"
        if self.kind == "stream":
            split = "by block" if self.fragment_split == "strided" else "attention / MLP halves"
            parts = [f"streaming DiLoCo H={self.sync_every}, K={self.fragments} ({split}), τ={self.overlap}, "
                     f"α={self.alpha:g}, {lr}"]
        else:
            parts = [f"{self.algorithm} H={self.sync_every}", lr]
        if self.split == "iid":
            parts.append("IID split")
        if self.compression != "none":
            scheme = (f"topk {self.density:.0%} {self.bits}-bit" if self.compression == "topk" else self.compression)
            if self.compression != "topk" and self.block != 256:
                scheme += f" (block {self.block})"
            if self.deflate:
                scheme += " deflated"
            if self.bf16_scales:
                scheme += ", bf16 scales"
            decay = f" (β {self.ef_decay:g})" if self.ef_decay != 1 else ""
            if self.up_momentum:
                parts.append(f"participants' own Nesterov {self.up_momentum:g} before compression")
            parts.append(f"{scheme} Δ" + (f" + error feedback{decay}" if self.error_feedback else ""))
            if self.download:
                parts.append(f"{scheme} downloads + server error feedback")
        if self.clip:
            parts.append(f"Δ clipped to {self.clip:g}" + (f", noise σ={self.noise:g}" if self.noise else ""))
        if self.sync_warmup:
            parts.append(f"first {self.sync_warmup} steps synchronous")
        return ", ".join(parts)


# ---- data, schedule, evaluation ----------------------------------------------------------------


def worker_tokens(setup: Setup, split: str) -> list[torch.Tensor]:
    """The training tokens of each participant: its stdlib shard, or a random 1/M of all."""
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


def load_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy weights in place, so the inner optimizer keeps pointing at the same tensors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


class Curve:
    """Held-out loss against tokens, evaluated every `eval_every` inner steps (or the round after)."""

    def __init__(self, setup: Setup, tokens_per_step: int | None = None) -> None:
        self.setup = setup
        self.tokens_per_step = tokens_per_step or setup.tokens_per_step
        self.batches = heldout_batches(setup)
        self.points: list[tuple[int, float]] = []
        self.next_at = 0

    def due(self, step: int) -> bool:
        return step >= self.next_at

    def maybe(self, model: torch.nn.Module, step: int, force: bool = False) -> None:
        if step >= self.next_at or force:
            self.points.append((step * self.tokens_per_step, evaluate(model, self.batches)))
            while self.next_at <= step:
                self.next_at += self.setup.eval_every


class Log:
    """Progress on stderr, `[run elapsed] message`: `progress` at most every `every_s` seconds
    (and at the last step), so that a long study's log shows it is alive without flooding it."""

    def __init__(self, name: str, every_s: float = 30.0, quiet: bool = False) -> None:
        self.name, self.every_s, self.quiet = name, every_s, quiet
        self.t0 = self.last = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.name} {time.perf_counter() - self.t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def progress(self, step: int, steps: int, curve: Curve, syncs: int | None = None) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and step < steps:
            return
        self.last = now
        tail = f", {syncs} syncs" if syncs is not None else ""
        self(f"step {step}/{steps} ({step / steps:.0%}) eval {curve.points[-1][1]:.4f}{tail}")


class Traffic:
    """Bytes of the federated runs: totals over all participants, and the peak of one sync event
    (the largest upload + download of one participant at one sync)."""

    def __init__(self) -> None:
        self.up = self.down = self.peak = self.syncs = 0

    def sync(self, uploads: Sequence[int], download: int) -> None:
        self.up += sum(uploads)
        self.down += len(uploads) * download
        self.peak = max(self.peak, max(uploads) + download)

    def result(self, extra: int = 0) -> dict[str, int]:
        return {"bytes": extra + self.up + self.down, "bytes_up": self.up, "bytes_down": self.down,
                "peak_sync_bytes": self.peak}


# ---- the runs ----------------------------------------------------------------------------------


def run_dp(setup: Setup, method: Method, log: Log) -> dict[str, Any]:
    model, opt = new_model(setup)
    streams = worker_streams(setup, method.split)
    if method.kind == "solo":
        streams = streams[:1]
    curve = Curve(setup, len(streams) * setup.batch_size * setup.seq_len)
    curve.maybe(model, 0)
    for step in range(setup.steps):
        inner_step(setup, model, opt, [s.next_batch() for s in streams], step)
        curve.maybe(model, step + 1, force=step + 1 == setup.steps)
        log.progress(step + 1, setup.steps, curve)
    n = count_parameters(model)
    dp = method.kind == "dp"
    # One step's all-reduce, sent and received by one worker: its peak per sync event.
    # Its initial broadcast: every worker receives the whole fp32 model once, as a participant does.
    initial = len(streams) * full_body_bytes(dict(model.named_parameters()), 0)
    return {"curve": curve.points, "bytes": dp_bytes(setup, n, setup.steps) if dp else 0, "bytes_up": 0,
            "bytes_initial": initial,
            "bytes_down": 0, "peak_sync_bytes": 2 * dp_bytes(setup, n, 1) // setup.workers if dp else 0,
            "rounds": setup.steps, "params": n, "_params": dict(model.named_parameters())}


def run_fed(setup: Setup, method: Method, log: Log) -> dict[str, Any]:
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
    outer = OuterOptimizer(dict(glob.named_parameters()), method.algorithm, method.outer_hp())
    acc = RunningSum(outer.params)
    codec = codec_of(method)
    uplinks = [Uplink(codec, method.error_feedback, method.ef_decay, method.up_momentum) for _ in streams]
    downlink = Downlink(codec if method.download else None, outer.params)
    privacy = (Privacy(method.clip, method.noise, math.ceil((setup.steps - step) / method.sync_every))
               if method.clip else None)
    initial = len(streams) * full_body_bytes(outer.params, 0)
    traffic, norms = Traffic(), []
    while step < setup.steps:
        h = min(method.sync_every, setup.steps - step)
        tokens, deltas, uploads = {}, [], []
        for k, ((model, opt), stream) in enumerate(zip(workers, streams, strict=True)):
            load_params(model, outer.params)  # P: the published model (`Downlink.publish` set the outer's to it)
            for t in range(step, step + h):
                inner_step(setup, model, opt, [stream.next_batch()], t)
            delta = pseudo_gradient(outer.params, dict(model.named_parameters()))
            norms.append(l2_norm(delta))
            if privacy is not None:
                delta = privacy.clip_delta(delta)
            nbytes, delta = uplinks[k].send(delta)
            uploads.append(nbytes)
            tokens[str(k)] = h * setup.batch_size * setup.seq_len
            deltas.append(delta)
        weights = contribution_weights(tokens)
        for k, delta in enumerate(deltas):
            acc.add(delta, weights[str(k)])
        mean = acc.mean()
        if privacy is not None:
            privacy.noise_mean(mean, weights)
        outer.step(mean)
        acc.reset()
        traffic.syncs += 1
        step += h
        # Every participant then downloads the new global model (fp32 safetensors, as served) or its compressed delta.
        traffic.sync(uploads, downlink.publish(outer.params))
        load_params(glob, outer.params)
        curve.maybe(glob, step, force=step == setup.steps)
        log.progress(step, setup.steps, curve, traffic.syncs)
    extra = privacy.result() if privacy is not None else {}
    return {"curve": curve.points, **traffic.result(warm_bytes), "rounds": traffic.syncs, "params": n_params,
            "bytes_initial": initial, "delta_norms": norm_summary(norms), **extra, "_params": outer.params,
            "_published": downlink}


def study_fragments(names: Sequence[str], method: Method) -> list[list[str]]:
    """The K fragments of a streaming run (`fedtrain.streaming.fragments`). "strided": by block,
    fragment p holds blocks p, p + K, ... "sublayer": the same over the built-in GPT's half
    blocks (block j's `ln_1` + `attn`, then its `ln_2` + `mlp`), so that its 2 blocks make 4
    fragments; embeddings go with the first half block, `ln_f` with the last (as by block)."""
    if method.fragment_split == "strided":
        return fragments(names, method.fragments, "strided")
    if method.fragment_split != "sublayer":
        raise ValueError(f"unknown fragment split {method.fragment_split!r} of {method.name}; use one of {SPLITS}")
    n_blocks = 1 + max(int(n.split(".")[1]) for n in names if n.startswith("blocks."))
    halves = [[f"blocks.{j}.ln_{i + 1}.*", f"blocks.{j}.{part}.*"]
              for j in range(n_blocks) for i, part in enumerate(("attn", "mlp"))]
    halves[0] += ["wte.*", "wpe.*"]
    halves[-1].append("ln_f.*")
    k = method.fragments
    return fragments(names, k, [[pat for u in range(p, len(halves), k) for pat in halves[u]] for p in range(k)])


class Fragments:
    """The global side of a streaming run: per fragment its global copy θ_g^p, which lives in its
    own `OuterOptimizer`, its `RunningSum`, and the mean Δ in flight between send and apply."""

    def __init__(self, glob: torch.nn.Module, method: Method, setup: Setup, traffic: Traffic) -> None:
        init = dict(glob.named_parameters())
        self.names = study_fragments(list(init), method)
        self.outers = [OuterOptimizer({n: init[n] for n in names}, method.algorithm, method.outer_hp())
                       for names in self.names]
        codec = codec_of(method)  # one error feedback per participant (and the server's) serves every fragment
        self.uplinks = [Uplink(codec, method.error_feedback, method.ef_decay, method.up_momentum)
                        for _ in range(setup.workers)]
        self.downlink = Downlink(codec if method.download else None, init)
        self.sums = [RunningSum(o.params) for o in self.outers]
        self.in_flight: dict[int, tuple[dict[str, torch.Tensor], list[int]]] = {}
        self.sent_at = [0] * len(self.names)  # the step of each fragment's last send (0: the start)
        self.alpha, self.setup, self.traffic = method.alpha, setup, traffic

    def send(self, p: int, step: int, local: list[dict[str, torch.nn.Parameter]]) -> None:
        """Every participant's Δ^p = θ_g^p − θᵢ^p now, token-weighted into the mean that is applied later."""
        per_worker = (step - self.sent_at[p]) * self.setup.batch_size * self.setup.seq_len
        weights = contribution_weights({str(i): per_worker for i in range(len(local))})
        uploads = []
        for i, params in enumerate(local):
            delta = pseudo_gradient(self.outers[p].params, {n: params[n] for n in self.names[p]})
            nbytes, delta = self.uplinks[i].send(delta)
            uploads.append(nbytes)
            self.sums[p].add(delta, weights[str(i)])
        self.in_flight[p] = (self.sums[p].mean(), uploads)
        self.sent_at[p] = step

    @torch.no_grad()
    def apply(self, p: int, local: list[dict[str, torch.nn.Parameter]]) -> None:
        """θ_g^p ← OuterOpt_p(θ_g^p, Δ̄^p); every participant's θ^p ← (1−α)·θ_g^p + α·θ_local^p,
        θ_local read now (after the τ steps since the send), as torchft does."""
        mean, uploads = self.in_flight.pop(p)
        theta_local = [{n: params[n].detach().clone() for n in self.names[p]} for params in local]
        outer = self.outers[p]
        outer.step(mean)
        self.sums[p].reset()
        self.traffic.syncs += 1
        download = self.downlink.publish(outer.params)  # the fragment's P: what the participants mix in
        self.traffic.sync(uploads, download)
        for params, loc in zip(local, theta_local, strict=True):
            for n, g in outer.params.items():
                params[n].copy_(g)
                params[n].lerp_(loc[n], self.alpha)

    def flush(self, step: int, local: list[dict[str, torch.nn.Parameter]]) -> int:
        """At the end: apply what is in flight, then sync (τ = 0) every fragment whose last Δ was
        taken before `step`, one fragment per event. Returns the number of sync events."""
        before = self.traffic.syncs
        for p in range(len(self.names)):
            if p in self.in_flight:
                self.apply(p, local)
            if self.sent_at[p] != step:
                self.send(p, step, local)
                self.apply(p, local)
        return self.traffic.syncs - before

    def params(self) -> dict[str, torch.Tensor]:
        return {n: v for o in self.outers for n, v in o.params.items()}


def run_stream(setup: Setup, method: Method, log: Log, flush: bool = True) -> dict[str, Any]:
    """Streaming DiLoCo: the participants step in lockstep, and after each inner step
    `fedtrain.streaming.schedule` says which fragment is sent and which applied. `flush=False`
    ends as torchft does (nothing synced after the last step), for a comparison with
    `fedtrain.streaming.simulate`; "_local" holds every participant's final weights."""
    h, k, tau = method.sync_every, method.fragments, method.overlap
    check_schedule(h, k, tau)
    if method.clip:
        raise ValueError(f"{method.name}: the study's streaming runs have no DP (clip/noise); use kind fed")
    if not 0.0 <= method.alpha <= 1.0:
        raise ValueError(f"α of {method.name} must be within [0, 1], got {method.alpha}")
    streams = worker_streams(setup, method.split)
    glob, _ = new_model(setup)  # the global model, assembled from the fragments to be evaluated
    curve = Curve(setup)
    curve.maybe(glob, 0)
    traffic = Traffic()
    frags = Fragments(glob, method, setup, traffic)
    workers = [new_model(setup) for _ in streams]
    local = [dict(model.named_parameters()) for model, _ in workers]
    for step in range(1, setup.steps + 1):
        for (model, opt), stream in zip(workers, streams, strict=True):
            inner_step(setup, model, opt, [stream.next_batch()], step - 1)
        ev = schedule(step, h, k, tau)
        if ev.send is not None:
            frags.send(ev.send, step, local)
        if ev.apply is not None:
            frags.apply(ev.apply, local)
            if curve.due(step) and step < setup.steps:  # the last step is evaluated after the flush
                load_params(glob, frags.params())
                curve.maybe(glob, step)
        log.progress(step, setup.steps, curve, traffic.syncs)
    flushed = frags.flush(setup.steps, local) if flush else 0
    load_params(glob, frags.params())
    curve.maybe(glob, setup.steps, force=True)
    sizes = [sum(o.params[n].numel() for n in names) for o, names in zip(frags.outers, frags.names, strict=True)]
    return {"curve": curve.points, **traffic.result(), "rounds": traffic.syncs, "flush_syncs": flushed,
            "params": count_parameters(glob), "bytes_initial": len(local) * full_body_bytes(frags.params(), 0),
            "fragment_params": sizes, "_params": frags.params(), "_local": local}


RUNS = {"dp": run_dp, "solo": run_dp, "fed": run_fed, "stream": run_stream}


def check_stream_is_diloco(setup: Setup, h: int = 10) -> str:
    """Streaming with K = 1, τ = 0, α = 0 must be DiLoCo bit for bit in this simulation: the same
    global weights, held-out curve, bytes and syncs. A run of 2.5·H steps, so the flush at the end
    meets DiLoCo's last, partial round. Raises AssertionError naming what differs."""
    setup = replace(setup, steps=h * 5 // 2, eval_every=h)
    quiet = Log("check", quiet=True)
    out = [RUNS[m.kind](setup, m, quiet) for m in (Method("check-diloco", "check", sync_every=h),
                                                    Method("check-stream", "check", kind="stream", sync_every=h))]
    a, b = out
    differ = [n for n in a["_params"] if not torch.equal(a["_params"][n], b["_params"][n])]
    assert a["_params"].keys() == b["_params"].keys() and not differ, f"global weights differ: {differ}"
    for key in ("curve", "bytes", "bytes_up", "bytes_down", "peak_sync_bytes", "rounds"):
        assert a[key] == b[key], f"{key} differs: DiLoCo {a[key]} vs streaming K=1 {b[key]}"
    return (f"check: streaming K=1 τ=0 α=0 equals DiLoCo bit for bit ({len(a['_params'])} tensors, "
            f"{setup.steps} steps at H={h}, {a['rounds']} syncs, {len(a['curve'])} evaluations, {a['bytes']:,} bytes)")
