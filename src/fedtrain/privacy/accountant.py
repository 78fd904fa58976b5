"""Participant-level (ε, δ) accounting for a run, with Google's `dp-accounting`, and the budget rule.

One round is one Gaussian mechanism with noise multiplier σ over participant-level neighbours
(add or remove one participant's whole contribution, clipped to C): `GaussianDpEvent(σ)` when
every participant takes part every round, `PoissonSampledDpEvent(q, GaussianDpEvent(σ))` when
each is sampled with probability q = expected cohort / population. Rounds compose; the RDP
accountant (default) or the PLD accountant (tighter, slower) turns them into ε at the target δ.

Budget rule (a choice, documented in docs/privacy.md): a run whose *planned* rounds would spend
more than its ε budget is refused before it starts (`check_budget` says why); `PrivacyLedger`
then records ε after each round, and `privacy_spent` is the record kept in checkpoint metadata.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from fedtrain.errors import ConfigError
from fedtrain.privacy.deps import dp_accounting

Sampling = Literal["all", "poisson"]
AccountantKind = Literal["rdp", "pld"]


@dataclass(frozen=True)
class DpSettings:
    """The run's DP settings: σ, δ, the ε budget, the rounds planned, and how participants are sampled."""

    noise_multiplier: float
    target_delta: float
    epsilon_budget: float
    rounds: int
    sampling: Sampling = "all"
    expected_cohort: int | None = None
    population: int | None = None
    accountant: AccountantKind = "rdp"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ConfigError(f"the noise multiplier σ must be positive, got {self.noise_multiplier}")
        if not 0 < self.target_delta < 1:
            raise ConfigError(f"δ must be in (0, 1), got {self.target_delta}")
        if not self.epsilon_budget > 0:
            raise ConfigError(f"the ε budget must be positive, got {self.epsilon_budget}")
        if not 1 <= self.rounds <= 10_000_000:
            raise ConfigError(f"rounds must be 1..10000000, got {self.rounds}")
        if self.sampling not in ("all", "poisson") or self.accountant not in ("rdp", "pld"):
            raise ConfigError(f"sampling is 'all' or 'poisson' and accountant 'rdp' or 'pld', got {self.sampling!r}, "
                              f"{self.accountant!r}")
        if self.sampling == "poisson":
            cohort, population = self.expected_cohort, self.population
            if cohort is None or population is None or not 1 <= cohort <= population:
                raise ConfigError("Poisson sampling needs 1 <= expected_cohort <= population")

    @property
    def sampling_rate(self) -> float:
        if self.sampling == "all":
            return 1.0
        assert self.expected_cohort is not None and self.population is not None
        return self.expected_cohort / self.population


def round_event(settings: DpSettings) -> Any:
    """The DpEvent of one round."""
    dpa = dp_accounting()
    gaussian = dpa.GaussianDpEvent(settings.noise_multiplier)
    if settings.sampling == "all":
        return gaussian
    return dpa.PoissonSampledDpEvent(settings.sampling_rate, gaussian)


def _accountant(kind: AccountantKind) -> Any:
    dpa = dp_accounting()
    return dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()


def epsilon_after(settings: DpSettings, rounds: int) -> float:
    """ε at `settings.target_delta` after `rounds` rounds (0 rounds: 0)."""
    if rounds < 0:
        raise ConfigError(f"rounds must be >= 0, got {rounds}")
    if rounds == 0:
        return 0.0
    acc = _accountant(settings.accountant)
    acc.compose(round_event(settings), rounds)
    return float(acc.get_epsilon(settings.target_delta))


def check_budget(settings: DpSettings) -> tuple[bool, str]:
    """Whether the planned rounds stay within the ε budget, and why (pure: the decision and its reason)."""
    eps = epsilon_after(settings, settings.rounds)
    if eps <= settings.epsilon_budget:
        return True, (f"{settings.rounds} rounds at σ={settings.noise_multiplier} spend ε={eps:.4g} "
                      f"<= budget {settings.epsilon_budget} (δ={settings.target_delta})")
    return False, (f"{settings.rounds} rounds at σ={settings.noise_multiplier} would spend ε={eps:.4g}, over the "
                   f"budget {settings.epsilon_budget} (δ={settings.target_delta}): raise σ, lower the rounds or "
                   "sample fewer participants per round")


def refuse_over_budget(settings: DpSettings) -> None:
    ok, reason = check_budget(settings)
    if not ok:
        raise ConfigError(reason)


def privacy_spent(settings: DpSettings, rounds_done: int) -> dict[str, Any]:
    """The record for checkpoint metadata and status: settings, rounds done, ε so far (JSON-able)."""
    return {
        "epsilon": epsilon_after(settings, rounds_done),
        "delta": settings.target_delta,
        "rounds_done": rounds_done,
        "settings": asdict(settings),
        "accountant": f"dp-accounting {settings.accountant}",
    }


class PrivacyLedger:
    """ε after each round: composes one round event per `record_round`, so a round with a different
    cohort (and sampling rate) can be recorded as it was run."""

    def __init__(self, settings: DpSettings) -> None:
        self.settings = settings
        self._acc = _accountant(settings.accountant)
        self._rounds = 0

    def record_round(self, sampling_rate: float | None = None) -> float:
        """Account one round (at `sampling_rate`, default the settings'); returns ε so far."""
        dpa = dp_accounting()
        q = self.settings.sampling_rate if sampling_rate is None else sampling_rate
        if not 0 < q <= 1:
            raise ConfigError(f"a sampling rate is in (0, 1], got {q}")
        gaussian = dpa.GaussianDpEvent(self.settings.noise_multiplier)
        self._acc.compose(gaussian if q == 1 else dpa.PoissonSampledDpEvent(q, gaussian))
        self._rounds += 1
        return self.epsilon()

    def epsilon(self) -> float:
        return float(self._acc.get_epsilon(self.settings.target_delta)) if self._rounds else 0.0

    def rounds(self) -> int:
        return self._rounds

    def over_budget(self) -> bool:
        return self.epsilon() > self.settings.epsilon_budget

    def spent(self) -> dict[str, Any]:
        """`privacy_spent`'s record for the rounds recorded so far (at their own sampling rates)."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.settings.target_delta,
            "rounds_done": self._rounds,
            "settings": asdict(self.settings),
            "accountant": f"dp-accounting {self.settings.accountant}",
        }
