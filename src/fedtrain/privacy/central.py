"""Central differential privacy in a run: the run's ε after n rounds, the budget rule for a config,
the noise a round's merge gets, and the record the status and each checkpoint carry.

`CentralDp` is owned by the coordinator's round loop (`coordinator/rounds/progress.py`): one round
merged with noise is one Gaussian mechanism of noise multiplier σ over participant-level
neighbours (one participant's clipped update replaced by zero: its token weight, public, stays),
of sensitivity w_max·C on the weighted mean. Every participant takes part in every round
(sampling "all") and σ is fixed for the run, so n rounds compose to exactly one Gaussian
mechanism of noise multiplier σ/√n: `run_epsilon` uses that for the PLD accountant (composing
n PLD events one by one is slow and needs memory growing with n), and dp-accounting's own
composition for RDP. A test checks both against dp-accounting composing the rounds itself.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from fedtrain.errors import ConfigError
from fedtrain.privacy.accountant import DpSettings, epsilon_after
from fedtrain.privacy.deps import dp_accounting

#: Above this ε (by RDP, an upper bound of PLD's) the PLD accountant is not asked: its grid grows
#: with ε (gigabytes past a few hundred), and a guarantee that weak needs no tighter figure.
PLD_EPSILON_CAP = 64.0
#: The status and metadata key of the record (`CentralDp.view`).
META_KEY = "fedtrain.privacy"
#: The most rounds `rounds_within` searches.
MAX_ROUNDS = 1_000_000_000


def settings_of(p: Any, rounds: int) -> DpSettings:
    """The accountant's settings for the config's privacy section `p` and `rounds` planned (0: no end)."""
    budget = p.epsilon_budget if p.epsilon_budget is not None else math.inf
    return DpSettings(p.noise_multiplier, p.delta, budget, min(max(1, rounds), 10_000_000), accountant=p.accountant)


def run_epsilon(settings: DpSettings, rounds: int) -> tuple[float, str]:
    """ε at δ after `rounds` rounds, and the accountant that gave it ("rdp", or "pld" unless the
    RDP bound is past PLD_EPSILON_CAP)."""
    if rounds <= 0:
        return 0.0, settings.accountant
    rdp = epsilon_after(replace(settings, accountant="rdp"), rounds)
    if settings.accountant == "rdp" or rdp > PLD_EPSILON_CAP:
        return rdp, "rdp"
    # n Gaussian mechanisms of multiplier σ (sensitivity 1) are exactly one of multiplier σ/√n.
    one = replace(settings, noise_multiplier=settings.noise_multiplier / math.sqrt(rounds), rounds=1)
    return epsilon_after(one, 1), "pld"


def budget_refusal(p: Any, rounds: int) -> str | None:
    """Why `rounds` planned rounds under the privacy section `p` do not fit its ε budget (None: they do)."""
    if p.epsilon_budget is None:
        return None
    eps, _ = run_epsilon(settings_of(p, rounds), rounds)
    if eps <= p.epsilon_budget:
        return None
    return (f"{rounds} rounds at σ={p.noise_multiplier:g} would spend ε={eps:.4g} at δ={p.delta:g}, over the budget "
            f"{p.epsilon_budget:g}: raise privacy.noise_multiplier or lower rounds ({rounds_within(p)})")


def rounds_within(p: Any) -> str:
    """The most rounds the budget of `p` allows, in words (found with the RDP accountant, an upper
    bound of ε: PLD allows at least as many)."""
    if p.epsilon_budget is None:
        return "no budget set"
    try:
        settings = replace(settings_of(p, 1), accountant="rdp")
        lo, hi = 0, 1
        while hi <= MAX_ROUNDS and epsilon_after(settings, hi) <= p.epsilon_budget:
            lo, hi = hi, hi * 2
        hi = min(hi, MAX_ROUNDS + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if epsilon_after(settings, mid) <= p.epsilon_budget else (lo, mid)
    except ConfigError as e:
        return e.message
    if lo == 0:
        return f"not one round fits ε {p.epsilon_budget:g} at σ={p.noise_multiplier:g}"
    return f"σ={p.noise_multiplier:g} allows at most {lo:,} rounds within ε {p.epsilon_budget:g} by RDP"


def noise_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one round's noise, seeded from the OS CSPRNG (never from the run's seed, which
    participants know: noise they could draw themselves would protect nothing)."""
    g = torch.Generator(device=device)
    g.manual_seed(secrets.randbits(63))
    return g


def add_noise_to_sum(total: Mapping[str, torch.Tensor], divisor: float, std: float,
                     generator: torch.Generator) -> None:
    """Add N(0, std²) to each coordinate of the mean total / divisor, in place in the sum `total`
    (N(0, (std·divisor)²) on each of its floating tensors), one tensor's noise in memory at a time."""
    if not (math.isfinite(std) and std >= 0 and math.isfinite(divisor) and divisor > 0):
        raise ConfigError(f"noise needs a finite std >= 0 and divisor > 0, got {std}, {divisor}")
    if std == 0:
        return
    for t in total.values():
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=generator, dtype=t.dtype, device=t.device)
            t.add_(noise, alpha=std * divisor)


class CentralDp:
    """The run's central DP: the settings in force, the rounds merged with noise, ε so far. The
    round loop's worker thread records a round; the event loop reads the view: the count and its
    ε change together, as one tuple."""

    def __init__(self, p: Any, planned_rounds: int, rounds_done: int = 0) -> None:
        """Raises ConfigError without dp-accounting (naming the extra), or when the planned rounds
        spend more than the budget (a config validated where dp-accounting was missing)."""
        dp_accounting()
        refusal = budget_refusal(p, planned_rounds)
        if refusal is not None:
            raise ConfigError(f"privacy.epsilon_budget: {refusal}")
        self.config = p
        self.settings = settings_of(p, planned_rounds)
        self._spent = self._account(rounds_done)

    @property
    def rounds(self) -> int:
        return self._spent[0]

    @property
    def epsilon(self) -> float:
        return self._spent[1]

    def noise_std(self, shares: Mapping[str, float]) -> float:
        """σ·w_max·C for a round whose updates have the capped `shares` of its mean (w_max 1 if none)."""
        w_max = max((s for s in shares.values() if s > 0), default=1.0)
        return float(self.config.noise_multiplier * min(1.0, w_max) * self.config.clip_norm)

    def _account(self, rounds: int) -> tuple[int, float, str, bool]:
        """(rounds, ε, the accountant that gave it, whether one more round would pass the budget)."""
        budget = self.config.epsilon_budget
        full = budget is not None and run_epsilon(self.settings, rounds + 1)[0] > budget
        return (rounds, *run_epsilon(self.settings, rounds), full)

    def record_round(self) -> None:
        """One more round merged with noise: ε recomputed."""
        self._spent = self._account(self._spent[0] + 1)

    def exhausted(self) -> bool:
        """Whether one more round would spend more than the budget: the run stops there. The
        budget rule refuses a config whose planned rounds pass it, so this happens only when more
        rounds were merged than planned: merges rolled back after a failed commit count too."""
        return self._spent[3]

    def view(self) -> dict[str, Any]:
        """The record for the status and the checkpoint metadata (plain JSON)."""
        p, budget = self.config, self.config.epsilon_budget
        rounds, eps, accountant, _ = self._spent
        return {
            # distributed: with secure aggregation each participant adds its share of the noise
            "mechanism": "distributed" if getattr(p, "secure_aggregation", False) else "central",
            "epsilon": eps,
            "delta": p.delta,
            "rounds": rounds,
            "budget": budget,
            "over_budget": budget is not None and eps > budget,
            "budget_spent": self._spent[3],  # one more round would pass the budget: the run stops
            "noise_multiplier": p.noise_multiplier,
            "clip_norm": p.clip_norm,
            "accountant": f"dp-accounting {accountant}",
            "neighbours": "participant-level, zero-out (one participant's update replaced by zero)",
        }

    def metadata(self) -> dict[str, str]:
        return {META_KEY: json.dumps(self.view())}


def rounds_in(metadata: Mapping[str, str]) -> int | None:
    """The rounds merged with noise that a version's metadata records (None: it records none)."""
    raw = metadata.get(META_KEY)
    if raw is None:
        return None
    try:
        rounds = json.loads(raw)["rounds"]
    except (ValueError, KeyError, TypeError):
        return None
    return rounds if isinstance(rounds, int) and rounds >= 0 else None
