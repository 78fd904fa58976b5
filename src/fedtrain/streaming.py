"""Streaming DiLoCo as torchft 0.2.0 runs it, the pure parts: `fragments` (which parameter goes
where: strided or sequential by block, or name patterns), `schedule` (what happens after an inner
step) and `simulate` (M replicas doing exactly what torchft's `DiLoCo` does, in one process: the
reference the coordinator and the participants are checked against). No I/O; torch only. What
torchft does, read from its source, and why the fragments are cut as they are: docs/streaming.md.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from fedtrain.errors import ConfigError

TensorDict = dict[str, torch.Tensor]

#: A transformer block's parameters: `blocks.<i>.` (the built-in GPT), `layers.<i>.` (Llama,
#: Qwen, ...) or `h.<i>.` (GPT-2), anywhere in the name (LoRA wrappers add prefixes).
BLOCK_PATTERN = r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\."

STRATEGIES = ("strided", "sequential")

_MAX_LISTED = 10


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    rest = len(items) - _MAX_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


# ---------------------------------------------------------------- fragments


def fragments(
    names: Sequence[str],
    k: int,
    strategy: str | Sequence[Sequence[str]] = "strided",
    *,
    block_pattern: str = BLOCK_PATTERN,
) -> list[list[str]]:
    """The K fragments of the sync set `names` (in the model's parameter order): one list of
    names per fragment, each in the order of `names`; every name in exactly one fragment.

    `strategy`: "strided" (fragment p holds blocks p, p + K, ...), "sequential" (block j in
    fragment j·K // L of L blocks), or K lists of fnmatch patterns (`"blocks.0.*"`), one per
    fragment, matched against whole names. Blocks are found with `block_pattern`, a regex
    whose match in a name ends the block's prefix; names outside every block go with the
    block before them (see the module). Raises ConfigError naming what does not fit.
    """
    dup = sorted(n for n, c in Counter(names).items() if c > 1)
    if dup:
        raise ConfigError(f"parameter names repeat: {_listed(dup)}")
    if not names:
        raise ConfigError("the sync set is empty: there is nothing to split into fragments")
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown fragment strategy {strategy!r}; use one of {', '.join(STRATEGIES)} "
                              "or a list of name patterns per fragment")
        _check_k(k)
        return _by_block(names, k, strategy, block_pattern)
    if any(isinstance(p, str) for p in strategy):
        raise ConfigError("each fragment's patterns must be a list of strings, not one string")
    return _by_patterns(names, k, [list(p) for p in strategy])


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"the number of fragments must be a whole number ≥ 1, got {k!r}")


def _by_block(names: Sequence[str], k: int, strategy: str, block_pattern: str) -> list[list[str]]:
    regex = re.compile(block_pattern)
    block_of: list[str | None] = []
    blocks: dict[str, tuple[int, int]] = {}  # block prefix -> where it sorts (`_block_rank`)
    stacks: dict[str, int] = {}  # what comes before a block's number ("blocks.", "model.layers."), by first sight
    for name in names:
        m = regex.search(name)
        key = name[: m.end()] if m else None
        if m is not None and key is not None and key not in blocks:
            blocks[key] = _block_rank(m, stacks, len(blocks))
        block_of.append(key)
    blocks = dict(sorted(blocks.items(), key=lambda item: item[1]))
    if not blocks:
        raise ConfigError(f"no parameter name matches the block pattern {block_pattern!r}, so the model cannot be "
                          f"split by block (names: {_listed(list(names))}); give a list of name patterns per fragment")
    if len(blocks) < k:
        raise ConfigError(f"{k} fragments need at least {k} blocks, and the model has {len(blocks)} "
                          f"({_listed(list(blocks))}); use fewer fragments or name patterns")
    n = len(blocks)
    index = {b: (j % k if strategy == "strided" else j * k // n) for j, b in enumerate(blocks)}
    out: list[list[str]] = [[] for _ in range(k)]
    current = 0  # names before the first block go with it (block 0 is in fragment 0 either way)
    for name, key in zip(names, block_of, strict=True):
        if key is not None:
            current = index[key]
        out[current].append(name)
    return out


def _block_rank(m: re.Match[str], stacks: dict[str, int], seen: int) -> tuple[int, int]:
    """Where a block sorts: by its stack of blocks (in the order the stacks first appear), then by
    its number, so that blocks.10 comes after blocks.2 even where the names come sorted as
    strings (a safetensors file written by `safetensors.torch` lists them so). A pattern
    without a numbered group keeps the order the blocks first appear in."""
    number = m.group(1) if m.re.groups else None
    if number is None or not number.isdigit():
        return 0, seen
    stack = stacks.setdefault(m.string[: m.start(1)], len(stacks))
    return stack, int(number)


def _by_patterns(names: Sequence[str], k: int, patterns: list[list[str]]) -> list[list[str]]:
    if len(patterns) != k:
        raise ConfigError(f"{len(patterns)} pattern lists were given for {k} fragments; give one list per fragment")
    problems: list[str] = []
    for p, pats in enumerate(patterns):
        for pat in pats:
            if not any(fnmatchcase(n, pat) for n in names):
                problems.append(f"pattern {pat!r} of fragment {p} matches no parameter")
    out: list[list[str]] = [[] for _ in range(k)]
    unmatched: list[str] = []
    for name in names:
        owners = [p for p, pats in enumerate(patterns) if any(fnmatchcase(name, pat) for pat in pats)]
        if not owners:
            unmatched.append(name)
        elif len(owners) > 1:
            problems.append(f"{name} is matched by fragments {', '.join(map(str, owners))}")
        else:
            out[owners[0]].append(name)
    if unmatched:
        problems.append(f"no fragment's patterns match {_listed(unmatched)}")
    problems += [f"fragment {p} holds no parameter" for p, frag in enumerate(out) if not frag and not unmatched]
    if problems:
        raise ConfigError("the fragment patterns must put every parameter in exactly one fragment: "
                          + "; ".join(problems[:_MAX_LISTED]) + (" and more" if len(problems) > _MAX_LISTED else ""),
                          details={"problems": problems})
    return out


# ---------------------------------------------------------------- schedule


@dataclass(frozen=True)
class StepEvents:
    """What follows inner step t: the fragment whose Δ is sent, the fragment whose averaged
    result is applied (None: nothing). With τ = 0 both are the same fragment, send first."""

    send: int | None = None
    apply: int | None = None


def check_schedule(h: int, k: int, tau: int) -> int:
    """Check H, K and τ as torchft does and return S = H / K, the steps between two syncs."""
    for what, v in (("the sync interval H", h), ("the number of fragments K", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{what} must be a whole number ≥ 1, got {v!r}")
    if h % k:
        raise ConfigError(f"the sync interval H={h} must be a multiple of the number of fragments K={k} "
                          "(one fragment syncs every H/K inner steps)")
    s = h // k
    if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < s:
        raise ConfigError(f"the overlap τ must be a whole number with 0 ≤ τ < H/K = {s}, got {tau!r}: a fragment "
                          "must be applied before the next one is sent")
    return s


def schedule(step: int, h: int, k: int, tau: int) -> StepEvents:
    """The events after inner step `step` (1-based: the hook after the step-th optimizer step),
    when every sync commits: sync n (n = 0, 1, ...) moves fragment n mod K, sent after step
    (n+1)·H/K − τ and applied after step (n+1)·H/K. K = 1, τ = 0: plain DiLoCo, sync every H."""
    s = check_schedule(h, k, tau)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"inner steps count from 1, got {step!r}")
    send = ((step + tau) // s - 1) % k if (step + tau) % s == 0 else None
    apply = (step // s - 1) % k if step % s == 0 else None
    return StepEvents(send=send, apply=apply)


# ---------------------------------------------------------------- simulator


def nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer (paper and torchft): SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass
class Simulation:
    """What `simulate` ends with: each replica's local weights, every fragment's global
    weights θ_g (torchft's `original_parameters`, one dict over all fragments), the outer
    optimizers (one per fragment) and the events, as (step, "send" | "apply", fragment)."""

    local: list[TensorDict]
    global_weights: TensorDict
    outer: list[torch.optim.Optimizer]
    events: list[tuple[int, str, int]] = field(default_factory=list)


def simulate(
    build_model: Callable[[], nn.Module],
    batch: Callable[[int, int], Any],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    replicas: int,
    steps: int,
    h: int,
    fragment_names: Sequence[Sequence[str]],
    tau: int = 0,
    alpha: float = 0.0,
    outer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = nesterov,
) -> Simulation:
    """M = `replicas` copies of `build_model()` (which must build the same weights each time)
    doing Streaming DiLoCo for `steps` inner steps, as torchft's `DiLoCo` does (see the module).

    Each replica r takes its inner steps on `batch(r, t)` (t = 0, 1, ...): zero_grad,
    `loss(model, batch).backward()`, `inner_optimizer.step()`; then `schedule` says what is
    sent and applied. The mean of the pseudo-gradients is summed in replica order and divided
    by M, as torchft's all-reduce does (bit for bit the same sum for M = 2). Parameters in no
    fragment train locally and never sync, as in torchft.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be a whole number ≥ 1, got {replicas!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps must be a whole number ≥ 0, got {steps!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"the mixing factor α must be within [0, 1], got {alpha!r}")
    k = len(fragment_names)
    check_schedule(h, k, tau)
    models = [build_model() for _ in range(replicas)]
    params = [dict(m.named_parameters()) for m in models]
    _check_fragments(params, fragment_names)
    inners = [inner(list(m.parameters())) for m in models]
    # One global copy per fragment: every torchft replica holds the same θ_g and outer state.
    glob = [{n: params[0][n].detach().clone() for n in names} for names in fragment_names]
    outers = [outer(list(g.values())) for g in glob]
    in_flight: dict[int, TensorDict] = {}
    events: list[tuple[int, str, int]] = []
    for t in range(1, steps + 1):
        for r, model in enumerate(models):
            inners[r].zero_grad()
            loss(model, batch(r, t - 1)).backward()
            inners[r].step()
        ev = schedule(t, h, k, tau)
        if ev.send is not None:
            in_flight[ev.send] = _mean_delta(glob[ev.send], params)
            events.append((t, "send", ev.send))
        if ev.apply is not None:
            _apply(glob[ev.apply], outers[ev.apply], in_flight.pop(ev.apply), params, alpha)
            events.append((t, "apply", ev.apply))
    local = [{n: p.detach().clone() for n, p in ps.items()} for ps in params]
    global_weights = {n: v for g in glob for n, v in g.items()}
    return Simulation(local=local, global_weights=global_weights, outer=outers, events=events)


def _check_fragments(params: list[dict[str, nn.Parameter]], fragment_names: Sequence[Sequence[str]]) -> None:
    seen: set[str] = set()
    for p, names in enumerate(fragment_names):
        if not names:
            raise ConfigError(f"fragment {p} holds no parameter")
        unknown = [n for n in names if n not in params[0]]
        twice = [n for n in names if n in seen]
        if unknown or twice:
            raise ConfigError(f"fragment {p}: " + "; ".join(
                ([f"no such parameter: {_listed(unknown)}"] if unknown else [])
                + ([f"already in an earlier fragment: {_listed(twice)}"] if twice else [])))
        seen.update(names)
    for r, ps in enumerate(params[1:], start=1):
        for name in seen:
            if not torch.equal(ps[name], params[0][name]):
                raise ConfigError(f"replica {r} starts with other weights for {name}: build_model must build "
                                  "the same weights every time (torchft's init_sync=False assumes as much)")


@torch.no_grad()
def _mean_delta(glob: Mapping[str, torch.Tensor], params: list[dict[str, nn.Parameter]]) -> TensorDict:
    """Δ̄ = Σᵣ (θ_g − θᵣ) / M: torchft's pseudo-gradient, summed (all-reduce SUM) then divided."""
    out: TensorDict = {}
    for name, g in glob.items():
        total = g - params[0][name]
        for ps in params[1:]:
            total += g - ps[name]
        total /= len(params)
        out[name] = total
    return out


@torch.no_grad()
def _apply(glob: TensorDict, outer: torch.optim.Optimizer, mean: TensorDict,
           params: list[dict[str, nn.Parameter]], alpha: float) -> None:
    """θ_g ← OuterOpt(θ_g, Δ̄); then every replica's θ ← lerp(θ_g, θ_local, α), torchft's
    `perform_sync`: the local weights are read at apply time, θ_g is kept before the mix."""
    local = [{name: ps[name].detach().clone() for name in glob} for ps in params]
    for name, g in glob.items():
        g.grad = mean[name]
    outer.step()
    outer.zero_grad()
    for ps, loc in zip(params, local, strict=True):
        for name, g in glob.items():
            ps[name].copy_(g)
            ps[name].lerp_(loc[name], alpha)
