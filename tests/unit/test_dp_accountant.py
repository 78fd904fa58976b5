"""The accountant: ε for a known setting equals dp-accounting's own figure, computed directly;
the ledger's ε after each round matches; the budget rule refuses a run that would overspend."""

from __future__ import annotations

import json

import dp_accounting
import pytest

from fedtrain.errors import ConfigError
from fedtrain.privacy.accountant import (
    DpSettings,
    PrivacyLedger,
    check_budget,
    epsilon_after,
    privacy_spent,
    refuse_over_budget,
)


def _direct(event: dp_accounting.DpEvent, rounds: int, delta: float, kind: str) -> float:
    acc = dp_accounting.rdp.RdpAccountant() if kind == "rdp" else dp_accounting.pld.PLDAccountant()
    acc.compose(event, rounds)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("kind, rounds", [("rdp", 200), ("pld", 20)])  # PLD is slow over many rounds
def test_full_participation_matches_the_librarys_figure(kind: str, rounds: int) -> None:
    s = DpSettings(noise_multiplier=1.1, target_delta=1e-5, epsilon_budget=100.0, rounds=rounds, accountant=kind)
    want = _direct(dp_accounting.GaussianDpEvent(1.1), rounds, 1e-5, kind)
    assert epsilon_after(s, rounds) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_poisson_sampling_matches_the_librarys_figure(kind: str) -> None:
    s = DpSettings(1.0, 1e-6, 100.0, 500, sampling="poisson", expected_cohort=20, population=1000, accountant=kind)
    event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0))
    assert epsilon_after(s, 500) == pytest.approx(_direct(event, 500, 1e-6, kind), rel=1e-9)


def test_a_known_setting_gives_a_plausible_epsilon() -> None:
    """Abadi et al.'s MNIST setting (q = 0.01, σ = 4, 10 000 steps, δ = 1e-5) is ε ≈ 1.26 with the
    moments accountant; RDP is a little tighter. Guards against a wrong event (e.g. q = 1)."""
    s = DpSettings(4.0, 1e-5, 100.0, 10_000, sampling="poisson", expected_cohort=1, population=100)
    assert 0.8 < epsilon_after(s, 10_000) < 1.3


def test_the_ledger_records_epsilon_after_each_round() -> None:
    s = DpSettings(1.5, 1e-5, 100.0, 50)
    ledger = PrivacyLedger(s)
    assert ledger.epsilon() == 0.0 and not ledger.over_budget()
    seen = [ledger.record_round() for _ in range(5)]
    assert seen == sorted(seen) and seen[0] > 0
    assert seen[-1] == pytest.approx(epsilon_after(s, 5), rel=1e-9)
    assert ledger.rounds() == 5


def test_rounds_with_their_own_sampling_rate_compose_as_run() -> None:
    s = DpSettings(1.0, 1e-5, 100.0, 10, sampling="poisson", expected_cohort=10, population=100)
    ledger = PrivacyLedger(s)
    for q in (0.1, 0.05, 0.2):
        ledger.record_round(q)
    g = dp_accounting.GaussianDpEvent(1.0)
    direct = dp_accounting.rdp.RdpAccountant()
    for q in (0.1, 0.05, 0.2):
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, g))
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(ConfigError):
        ledger.record_round(0.0)


def test_a_run_that_would_exceed_its_budget_is_refused_with_the_reason() -> None:
    eps_100 = epsilon_after(DpSettings(1.0, 1e-5, 1.0, 100), 100)
    ok, reason = check_budget(DpSettings(1.0, 1e-5, eps_100 * 1.01, 100))
    assert ok and "<= budget" in reason
    over = DpSettings(1.0, 1e-5, eps_100 * 0.99, 100)
    ok, reason = check_budget(over)
    assert not ok and "over the budget" in reason and "raise σ" in reason
    with pytest.raises(ConfigError, match="over the budget"):
        refuse_over_budget(over)


def test_privacy_spent_is_a_json_record_for_the_checkpoint() -> None:
    s = DpSettings(2.0, 1e-5, 10.0, 30)
    record = privacy_spent(s, 12)
    assert json.loads(json.dumps(record)) == record
    assert record["epsilon"] == pytest.approx(epsilon_after(s, 12)) and record["rounds_done"] == 12
    ledger = PrivacyLedger(s)
    ledger.record_round()
    assert ledger.spent()["epsilon"] == pytest.approx(epsilon_after(s, 1))
    assert privacy_spent(s, 0)["epsilon"] == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": 0.0},
        {"target_delta": 1.0},
        {"epsilon_budget": -1.0},
        {"rounds": 0},
        {"sampling": "poisson"},
        {"sampling": "poisson", "expected_cohort": 5, "population": 4},
        {"accountant": "prv"},
    ],
)
def test_settings_are_checked(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"noise_multiplier": 1.0, "target_delta": 1e-5, "epsilon_budget": 5.0, "rounds": 10}
    with pytest.raises(ConfigError):
        DpSettings(**{**base, **kwargs})  # type: ignore[arg-type]
