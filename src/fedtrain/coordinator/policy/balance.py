"""Balanced rounds (issue #22): how many inner steps each participant is told for a round, and why.

A pure decision, like the other rules of `policy/`: throughputs, the previous smoothed values and
the schedule config are passed in, nothing reads a clock, a socket or the store. The
coordinator (`schedule.py`) asks it when a participant starts a round and records the answer.

More: docs/architecture.md, "coordinator/policy/balance.py".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fedtrain.config import ScheduleConfig

__all__ = ["MAX_RATE", "MIN_RATE", "Assignment", "Reported", "bounds", "clean_rate", "measured_rate",
           "plan_steps", "reference_rate", "smoothed"]

MIN_RATE = 1e-6
"""The slowest rate counted: one inner step in ~12 days. Slower claims count as this."""
MAX_RATE = 1e6
"""The fastest rate counted: a million inner steps a second. Faster claims count as this."""


@dataclass(frozen=True)
class Reported:
    """What a participant last reported about its speed (any field may be missing)."""

    steps_per_s: float | None = None  # its own inner-step rate, the syncs left out
    tokens_per_s: float | None = None  # its token rate (an older client's only figure)
    world_size: int = 1  # ranks of a torchrun group: its tokens per step are this many ranks'


@dataclass(frozen=True)
class Assignment:
    """A participant's inner steps for a round: `sync_every`, the smoothed rate it came from
    (None: no rate known; the next round's previous value) and the reason, in words."""

    sync_every: int
    steps_per_s: float | None
    reason: str


def clean_rate(value: object) -> float | None:
    """A rate as the rule counts it: None when missing, not a number, not finite or not
    above 0; else clamped to [MIN_RATE, MAX_RATE]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    rate = float(value)
    if not math.isfinite(rate) or rate <= 0:
        return None
    return min(max(rate, MIN_RATE), MAX_RATE)


def measured_rate(reported: Reported, tokens_per_step: int) -> float | None:
    """Inner steps per second from what a participant reported: its own step rate, or else its
    tokens/s ÷ the tokens of one of its steps (`tokens_per_step` per rank × its ranks)."""
    direct = clean_rate(reported.steps_per_s)
    if direct is not None:
        return direct
    tokens = clean_rate(reported.tokens_per_s)
    world = reported.world_size if isinstance(reported.world_size, int) and reported.world_size > 0 else 1
    if tokens is None or tokens_per_step <= 0:
        return None
    return clean_rate(tokens / (tokens_per_step * world))


def smoothed(measured: float | None, previous: float | None, smoothing: float) -> float | None:
    """The moving average of a rate, updated once a round: α·previous + (1 − α)·measured. A
    missing measurement keeps the previous value; a missing previous one takes the measurement."""
    now, before = clean_rate(measured), clean_rate(previous)
    if now is None or before is None:
        return now if now is not None else before
    return clean_rate(smoothing * before + (1 - smoothing) * now)


def bounds(base: int, cfg: ScheduleConfig) -> tuple[int, int]:
    """The fewest and the most inner steps a participant may be told, for a base H of `base`."""
    low = max(1, math.ceil(cfg.min_steps_factor * base - 1e-9))
    return low, max(low, math.floor(cfg.max_steps_factor * base + 1e-9))


def reference_rate(values: list[float]) -> float:
    """The rate a base H is meant for: the lower median (with an even count, the slower of
    the two middle rates). One participant's claim moves it by at most one place among the
    others' rates: with two, a liar that claims to be faster leaves the reference at the honest
    rate (the honest site keeps H), and one that claims to be slower only raises the honest
    site's H (to max_steps_factor x H at most). The mean of the two middle rates would follow
    the liar's claim to MAX_RATE and floor everyone else."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def plan_steps(base: int, measured: Mapping[str, float | None], previous: Mapping[str, float | None],
               cfg: ScheduleConfig) -> dict[str, Assignment]:
    """Every participant's inner steps for the next round (see the module docstring).

    `base`: the round's H (train.sync_every); `measured`: each participant's inner-step rate
    now (None: none yet); `previous`: its smoothed rate at its last assignment (absent: none)."""
    rates = {pid: smoothed(m, previous.get(pid), cfg.smoothing) for pid, m in measured.items()}
    known = [r for r in rates.values() if r is not None]
    low, high = bounds(base, cfg)
    unknown = f"no throughput measured yet -> H={base} (train.sync_every)"
    if not known:
        return {pid: Assignment(base, None, f"{pid}: {unknown}") for pid in measured}
    reference = reference_rate(known)
    out: dict[str, Assignment] = {}
    for pid, rate in sorted(rates.items()):
        if rate is None:
            out[pid] = Assignment(base, None, f"{pid}: {unknown}")
        elif len(known) == 1:
            out[pid] = Assignment(base, rate, f"{pid}: the only participant with a measured throughput "
                                              f"({rate:.3g} steps/s) -> H={base} (train.sync_every)")
        else:
            ratio = rate / reference
            wanted = math.floor(base * ratio + 0.5)
            h = min(max(wanted, low), high)
            bound = (f"at the floor, min_steps_factor {cfg.min_steps_factor:g}" if wanted < low else
                     f"at the cap, max_steps_factor {cfg.max_steps_factor:g}" if wanted > high else
                     f"bounded {cfg.min_steps_factor:g}-{cfg.max_steps_factor:g}x H")
            out[pid] = Assignment(h, rate, f"{pid}: {ratio:.2f}x the median throughput ({rate:.3g} of "
                                           f"{reference:.3g} steps/s, smoothed) -> H={h} of {base} ({bound})")
    return out
